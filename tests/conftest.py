"""Shared fixtures, and the rule that only ``gpu``-marked tests may skip."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.toy_corpus import make_docs

_bad_skips: list[str] = []


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.skipped and "gpu" not in report.keywords:
        _bad_skips.append(report.nodeid)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _bad_skips and exitstatus == 0:
        session.exitstatus = 1


def pytest_terminal_summary(terminalreporter) -> None:
    if _bad_skips:
        terminalreporter.write_line(f"FAILED: {len(_bad_skips)} test(s) skipped without the gpu marker:", red=True)
        for nodeid in _bad_skips:
            terminalreporter.write_line(f"  {nodeid}")


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """pool (prose + noise), target and val (prose only) jsonl files, a few hundred KB."""
    root = tmp_path_factory.mktemp("corpus")
    return {
        "pool": str(write_jsonl(root / "pool.jsonl", make_docs("p", 240, 0))),
        "target": str(write_jsonl(root / "target.jsonl", make_docs("t", 40, 1, ("prose",)))),
        "val": str(write_jsonl(root / "val.jsonl", make_docs("v", 40, 2, ("prose",)))),
    }


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SELECTION_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))
    monkeypatch.setenv("WANDB_MODE", "offline")
