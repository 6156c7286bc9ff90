"""The README stays short, its method table is the generator's output from the committed results, and
docs/architecture.md names every bench module."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def method_table():
    """docs/method_table.py (``docs`` imports as a namespace package from the repository root)."""
    return importlib.import_module("docs.method_table")


def test_readme_is_at_most_250_lines() -> None:
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= 250, f"README.md has {lines} lines; it is the package's long description: move detail to docs/"


def test_readme_method_table_is_generated_from_the_committed_results() -> None:
    table = method_table()
    text = (ROOT / "README.md").read_text()
    assert table.regenerated(text) == text, "stale tables: run python docs/method_table.py"


def test_method_table_rows_and_intervals() -> None:
    table = method_table()
    rendered = table.render()
    body = rendered.splitlines()[2:]
    assert len(body) == len(table.ROWS) and all(row.count("|") == 8 for row in body)
    assert any("(offline)" in row for row in body) and any("OPUS" in row for row in body)
    mean, half = table.paired_interval([-0.1, -0.12, -0.08])
    assert mean == pytest.approx(-0.1) and half == pytest.approx(4.303 * 0.02 / 3**0.5, rel=1e-3)
    assert table.tokens_to([[100, 1.0, 3.0], [200, 2.0, 2.0]], 2.5) == 150
    assert table.tokens_to([[100, 1.0, 3.0]], 2.0) is None
    sizes = table.render_sizes().splitlines()  # the ladder's rungs, smallest first, one row per online method
    assert len(sizes) == 2 + len(table.SIZE_METHODS) and sizes[0].index("cpu-mini") < sizes[0].index("cpu-small")
    cell = {"diff_mean": -0.5, "p_value": 0.01, "step": 1.25, "wall_charged": [0.5, 0.7]}
    assert table.size_cell(cell) == "-0.500 (p 0.010), 1.25×, 0.60×" and table.size_cell(None) == "–"
    assert table.size_cell({**cell, "p_value": 2e-4, "step": None}).startswith("-0.500 (p < 0.001), –,")


def test_a_rung_apart_is_headed_with_its_shape(monkeypatch) -> None:
    table = method_table()
    ladder = {"rungs": [{"name": "cpu-tiny", "params": 890_000, "tokens_per_param": 2.3, "learner": {"block_size": 128}},
                        {"name": "cpu-tiny-t512", "params": 1_900_000, "tokens_per_param": 22.4, "apart": True,
                         "learner": {"block_size": 512, "vocab_size": 4096}}],
              "cells": {"cpu-tiny": {}, "cpu-tiny-t512": {}}}
    monkeypatch.setattr(table, "load", lambda relative: ladder)
    assert table.render_sizes().splitlines()[0] == (
        "| method | cpu-tiny (0.89M parameters, 2.3 tokens per parameter) | cpu-tiny-t512 (1.90M parameters, "
        "22 tokens per parameter, T = 512, 4,096-token vocabulary: another shape, not a size) |")


def test_stale_table_is_detected(tmp_path) -> None:
    table = method_table()
    text = f"intro\n{table.START}\n| old |\n{table.END}\ntail\n"
    new = table.replaced(text, "| new |\n")
    assert new == f"intro\n{table.START}\n| new |\n{table.END}\ntail\n" and new != text


def python_block(path: Path, after: str) -> str:
    """The first ```python block after the heading ``after`` in a markdown file."""
    return path.read_text().split(after, 1)[1].split("```python", 1)[1].split("```", 1)[0]


def test_readme_and_contract_examples_select_in_a_fit() -> None:
    """The README's new method and the contract page's worked example run in a Trainer on the own-model page's learner."""
    import lightning as L
    import torch

    namespace: dict = {}
    learner = python_block(ROOT / "docs" / "own-model-and-data.md", "<!-- own-model:start -->")
    exec(learner.split("callback = HighLossSelection")[0], namespace)
    exec(python_block(ROOT / "README.md", "## Add a method"), namespace)
    exec(python_block(ROOT / "docs" / "contract.md", "## A worked example"), namespace)

    class WithLogits(namespace["TinyLM"]):
        def logits(self, ids: torch.Tensor) -> torch.Tensor:
            return self.head(torch.relu(self.mix(self.embed(ids))))

    for name in ("LowLossSelection", "TokenEntropySelection"):
        callback = namespace[name](ratio=0.5)
        trainer = L.Trainer(max_steps=2, callbacks=[callback], logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(WithLogits(), datamodule=namespace["MyData"]())
        assert callback.selections == 2 and callback.last_selected.numel() == 8


def test_readme_links_resolve() -> None:
    """Every relative link of the README names a file or folder of the repository (the site's strict build checks the rest)."""
    import re

    targets = re.findall(r"\]\(([^)#\s]+)", (ROOT / "README.md").read_text())
    missing = [t for t in targets if not re.match(r"[a-z]+:", t) and not (ROOT / t).exists()]
    assert targets and not missing, f"README.md links to missing paths: {missing}"


def test_architecture_names_every_bench_module() -> None:
    """docs/architecture.md lists each module of bench/harness and bench/studies by name."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    modules = [p for folder in ("harness", "studies") for p in sorted((ROOT / "bench" / folder).glob("*.py"))
               if p.name != "__init__.py"]
    missing = [str(p.relative_to(ROOT)) for p in modules if f"`{p.stem}`" not in text]
    assert not missing, f"docs/architecture.md does not name {missing}"
