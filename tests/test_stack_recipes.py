"""docs/stack.md's recipes run as written: the set-up block plus each stack's call, as a script in a subprocess.

Each recipe trains the toy corpus for 4 steps with a 2-layer GPT (the only substitutions: the data paths, the
sequence length, the model size, the step count and no logger or checkpoint files); the multi-process
ones start their second rank as Lightning does, by running the script again.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "stack.md"
RECIPES = ["compiled", "bf16", "checkpointing", "fsdp2", "ddp", "full"]


def recipe(name: str) -> str:
    """The ```python block after ``<!-- stack-recipe:NAME -->`` in docs/stack.md."""
    return PAGE.read_text().split(f"<!-- stack-recipe:{name} -->", 1)[1].split("```python", 1)[1].split("```", 1)[0]


def script(name: str, corpus: dict[str, str], cache: Path) -> str:
    setup = recipe("setup")
    for old, new in [('"data/default/pool.jsonl"', repr(corpus["pool"])), ('"data/default/target.jsonl"', repr(corpus["target"])),
                     ('"data/default/val.jsonl"', repr(corpus["val"])), ("seq_len=128", f"seq_len=32, cache_dir={str(cache)!r}"),
                     ("n_layer=4, n_head=4, n_embd=128", "n_layer=2, n_head=2, n_embd=32"),
                     ("max_steps=1000", "max_steps=4, logger=False, enable_checkpointing=False, limit_val_batches=0")]:
        assert old in setup, old
        setup = setup.replace(old, new)
    return setup + recipe(name)


@pytest.fixture(scope="module")
def runs(tiny_corpus, tmp_path_factory) -> dict[str, tuple[int, str]]:
    """Every recipe at once, each in its own folder: its exit code and output."""
    from selection_callbacks.data.datamodule import PoolDataModule

    root = tmp_path_factory.mktemp("recipes")
    cache = root / "cache"
    PoolDataModule(tiny_corpus["pool"], tiny_corpus["target"], tiny_corpus["val"], seq_len=32, cache_dir=str(cache),
                   progress=False).prepare_data()  # tokenized once, before the concurrent runs
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "WANDB_MODE": "offline"}
    procs = {}
    for name in RECIPES:
        (root / name).mkdir()
        (root / name / "recipe.py").write_text(script(name, tiny_corpus, cache))
        with open(root / name / "log", "w") as log:
            procs[name] = subprocess.Popen([sys.executable, "recipe.py"], cwd=root / name, env=env, stdout=log,
                                           stderr=subprocess.STDOUT)
    return {name: (proc.wait(timeout=600), (root / name / "log").read_text()) for name, proc in procs.items()}


@pytest.mark.parametrize("name", RECIPES)
def test_stack_recipe_trains(runs, name: str) -> None:
    code, output = runs[name]
    assert code == 0, output[-4000:]
    assert "max_steps=4` reached" in output, output[-2000:]
