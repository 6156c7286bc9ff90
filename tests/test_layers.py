"""The house's shape: layers import only downward, old paths stay aliases, functions stay short."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = ROOT / "selection_callbacks"
FRAMEWORK_FREE = ("core", "scoring", "nn")  # and data/, except its datamodule
OLD_PATHS = {
    "selection_callbacks.core.callback": "selection_callbacks.callbacks.base",
    "selection_callbacks.core.dashboard": "selection_callbacks.callbacks.dashboard",
    "selection_callbacks.core.recorder": "selection_callbacks.callbacks.recorder",
    "selection_callbacks.scoring.ghost_callback": "selection_callbacks.callbacks.ghost",
    "selection_callbacks.scoring.proxy_callback": "selection_callbacks.callbacks.proxy",
    "selection_callbacks.ledger": "selection_callbacks.cli.ledger",
    "selection_callbacks.data.default": "selection_callbacks.data.default_corpus",
    "selection_callbacks.offline.autodata_proposers": "selection_callbacks.offline.autodata.proposers",
    "selection_callbacks.offline.autodata_report": "selection_callbacks.offline.autodata.report",
    "selection_callbacks.offline.recipe": "selection_callbacks.offline.autodata.recipe",
    "models.gpt": "selection_callbacks.nn.gpt",
    "models.optim": "selection_callbacks.nn.optim",
    "models.lit_gpt": "selection_callbacks.learner.lit_gpt",
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_alias(path: Path) -> bool:
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    return doc.startswith("Old path")


def _modules(*packages: str) -> list[str]:
    """Importable library modules under ``packages`` (all of the library when empty), old-path aliases and ``__main__`` left out."""
    roots = [LIBRARY / p for p in packages] if packages else [LIBRARY]
    paths = [p for root in roots for p in sorted(root.rglob("*.py"))]
    return [_module_name(p) for p in paths if p.name != "__main__.py" and not _is_alias(p)]


def _imported_after(modules: list[str]) -> set[str]:
    """Top-level package names in ``sys.modules`` after a fresh interpreter imports ``modules``."""
    code = (
        "import importlib, json, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        "print(json.dumps(sorted({name.split('.')[0] for name in sys.modules})))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


def test_framework_free_layers_never_import_lightning() -> None:
    data = [m for m in _modules("data") if m != "selection_callbacks.data.datamodule"]
    modules = _modules(*FRAMEWORK_FREE) + data
    assert "selection_callbacks.core.selection" in modules and "selection_callbacks.scoring.ghost" in modules
    loaded = _imported_after(modules)
    assert "selection_callbacks" in loaded
    assert not loaded & {"lightning", "pytorch_lightning", "lightning_fabric", "torchmetrics"}, sorted(loaded)


def test_the_library_never_imports_models() -> None:
    loaded = _imported_after(_modules())
    assert "lightning" in loaded  # the whole library was imported
    assert "models" not in loaded


def test_old_paths_are_the_new_modules() -> None:
    for old, new in OLD_PATHS.items():
        assert importlib.import_module(old) is importlib.import_module(new), old
    from selection_callbacks.core.ledger import SelectionLedger, read_ledger
    from selection_callbacks.callbacks.ledger_writer import SelectionLedger as writer
    from selection_callbacks.core.ledger_store import read_ledger as reader

    assert SelectionLedger is writer and read_ledger is reader
    from selection_callbacks.offline.autodata import SearchConfig
    from selection_callbacks.offline.autodata.search import SearchConfig as search_config

    assert SearchConfig is search_config
    from selection_callbacks.scoring.proxy import ProxyLM, load_reference
    from selection_callbacks.learner.reference import load_reference as loader
    from selection_callbacks.scoring.proxy_models import ProxyLM as proxy_lm

    assert ProxyLM is proxy_lm and load_reference is loader
    from selection_callbacks.data.datamodule import candidates_per_rank, superbatch_size

    assert superbatch_size is candidates_per_rank


def test_checkpoints_pickled_under_the_old_module_names_load(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    import models.gpt  # noqa: F401  (the old path pickling resolves)
    from selection_callbacks.nn.gpt import GPTConfig

    config = GPTConfig(n_layer=1, n_embd=8, n_head=2)
    path = tmp_path / "old.pt"
    with monkeypatch.context() as m:
        m.setattr(GPTConfig, "__module__", "models.gpt")  # what checkpoints written before the move hold
        torch.save({"config": config}, path)
    assert b"models.gpt" in path.read_bytes()
    assert torch.load(path, weights_only=True)["config"] == config


def test_alias_files_are_thin() -> None:
    aliases = [p for p in sorted([*LIBRARY.rglob("*.py"), *(ROOT / "models").rglob("*.py")]) if _is_alias(p)]
    assert {_module_name(p) for p in aliases} >= set(OLD_PATHS) | {"selection_callbacks.scoring.proxy"}
    for path in aliases:
        assert len(path.read_text().splitlines()) <= 10, path


def _functions(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node.name, node.lineno, node.end_lineno - node.lineno + 1


def test_no_library_function_is_longer_than_60_lines() -> None:
    long = [f"{p.relative_to(ROOT)}:{line} {name} ({n} lines)" for p in sorted(LIBRARY.rglob("*.py"))
            for name, line, n in _functions(p) if n > 60]
    assert not long, long


def test_every_package_declares_its_public_names() -> None:
    for init in sorted(LIBRARY.rglob("__init__.py")):
        module = importlib.import_module(_module_name(init))
        assert isinstance(getattr(module, "__all__", None), list), init
        for name in module.__all__:
            assert hasattr(module, name) or importlib.util.find_spec(f"{module.__name__}.{name}"), (init, name)


@pytest.mark.parametrize("name", importlib.import_module("selection_callbacks").__all__)
def test_the_top_level_exports_every_callback(name: str) -> None:
    import lightning as L

    import selection_callbacks

    value = getattr(selection_callbacks, name)
    assert value.__name__ == name
    if name.endswith(("Selection", "Ledger", "Dashboard", "Recorder")):
        assert issubclass(value, L.Callback), name


LAYERS = ("core", "data", "nn", "scoring", "learner", "offline", "callbacks", "methods", "cli")  # bottom to top


def test_each_layer_imports_only_downward() -> None:
    upward = []
    for path in sorted(LIBRARY.rglob("*.py")):
        own = path.relative_to(LIBRARY).parts[0]
        if own not in LAYERS or _is_alias(path):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module] if isinstance(node, ast.ImportFrom) and node.module else (
                [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            for name in names:
                parts = name.split(".")
                if parts[0] == "selection_callbacks" and len(parts) > 1 and parts[1] in LAYERS:
                    if LAYERS.index(parts[1]) > LAYERS.index(own):
                        upward.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not upward, upward
