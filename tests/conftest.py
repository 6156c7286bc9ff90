"""Shared fixtures, and the rule that only ``gpu``-marked tests may skip."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

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


WORDS = "the model reads data and learns which tokens follow from the context it has seen before".split()


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def make_docs(prefix: str, n: int, seed: int, domains: tuple[str, ...] = ("prose", "noise"), length: int = 400) -> list[dict]:
    """Small deterministic documents: word prose or random printable noise."""
    r = random.Random(seed)
    rows = []
    for i in range(n):
        domain = domains[i % len(domains)]
        if domain == "noise":
            text = "".join(chr(r.randint(33, 126)) for _ in range(length))
        else:
            text = " ".join(r.choice(WORDS) for _ in range(length // 5))
        rows.append({"id": f"{prefix}{i}", "text": text, "domain": domain})
    return rows


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
