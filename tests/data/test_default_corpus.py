"""Tests for the offline default corpus builder."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from selection_callbacks.data.corpus_docs import CARD_FILE, MAX_DOC_BYTES, MIN_DOC_BYTES, SPLIT_FILES
from selection_callbacks.data.default_corpus import (
    DOMAINS,
    POOL_CAPS,
    build_default_corpus,
    is_up_to_date,
    main,
    render_card_markdown,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
ALL_FILES = (*SPLIT_FILES.values(), CARD_FILE)


def _read(out: Path) -> dict[str, list[dict]]:
    return {
        split: [json.loads(line) for line in (out / name).read_text(encoding="utf-8").splitlines()]
        for split, name in SPLIT_FILES.items()
    }


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict, dict[str, list[dict]]]:
    out = tmp_path_factory.mktemp("corpus")
    card = build_default_corpus(out, seed=0)
    return out, card, _read(out)


def test_files_and_fields(built) -> None:
    out, _, records = built
    assert all((out / name).is_file() for name in ALL_FILES)
    for docs in records.values():
        assert docs
        for doc in docs:
            assert set(doc) == {"id", "text", "domain"}
            assert all(isinstance(value, str) for value in doc.values())
            assert doc["domain"] in DOMAINS
            assert MIN_DOC_BYTES <= len(doc["text"].encode("utf-8")) <= MAX_DOC_BYTES


def test_ids_unique_and_splits_disjoint(built) -> None:
    _, _, records = built
    ids = [doc["id"] for docs in records.values() for doc in docs]
    texts = [doc["text"] for docs in records.values() for doc in docs]
    assert len(ids) == len(set(ids))
    assert len(texts) == len(set(texts))
    for a, b in [("pool", "target"), ("pool", "val"), ("target", "val")]:
        assert not {d["id"] for d in records[a]} & {d["id"] for d in records[b]}
        assert not {d["text"] for d in records[a]} & {d["text"] for d in records[b]}


def test_domains(built) -> None:
    _, card, records = built
    assert {d["domain"] for d in records["target"]} == {"prose"}
    assert {d["domain"] for d in records["val"]} == {"prose"}
    assert {d["domain"] for d in records["pool"]} == set(DOMAINS)
    for domain in DOMAINS:
        assert 0 < card["splits"]["pool"][domain]["bytes"] <= POOL_CAPS[domain]


def test_card_matches_files(built) -> None:
    out, card, records = built
    assert card == json.loads((out / CARD_FILE).read_text(encoding="utf-8"))
    assert card["seed"] == 0
    assert card["python_version"] == platform.python_version()
    for split, docs in records.items():
        for domain in DOMAINS:
            mine = [d for d in docs if d["domain"] == domain]
            assert card["splits"][split][domain] == {
                "docs": len(mine),
                "bytes": sum(len(d["text"].encode("utf-8")) for d in mine),
            }
    for name in SPLIT_FILES.values():
        assert card["sha256"][name] == hashlib.sha256((out / name).read_bytes()).hexdigest()
    table = render_card_markdown(card)
    assert table.count("\n") == len(DOMAINS) + 2
    assert f"| {card['splits']['target']['prose']['docs']} |" in table


def test_same_seed_is_byte_identical_across_processes(built, tmp_path: Path) -> None:
    out, _, _ = built
    env = {**os.environ, "PYTHONHASHSEED": "12345", "PYTHONPATH": str(REPO_ROOT)}
    command = [sys.executable, "-m", "selection_callbacks.data.default_corpus", "--out", str(tmp_path), "--seed", "0"]
    subprocess.run(command, cwd=REPO_ROOT, env=env, check=True, capture_output=True)
    for name in ALL_FILES:
        assert (tmp_path / name).read_bytes() == (out / name).read_bytes(), name


def test_different_seed_changes_split(built, tmp_path: Path) -> None:
    _, _, records = built
    card = build_default_corpus(tmp_path, seed=1)
    other = _read(tmp_path)
    assert card["seed"] == 1
    assert {d["id"] for d in other["target"]} != {d["id"] for d in records["target"]}
    assert {d["domain"] for split in ("target", "val") for d in other[split]} == {"prose"}


def test_rerun_skips_unless_forced(built, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, _, _ = built
    stamps = {name: (out / name).stat().st_mtime_ns for name in ALL_FILES}
    assert main(["--out", str(out), "--seed", "0"]) == 0
    assert "up to date" in capsys.readouterr().out
    assert stamps == {name: (out / name).stat().st_mtime_ns for name in ALL_FILES}
    assert not is_up_to_date(out, seed=1)

    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    (copy / SPLIT_FILES["val"]).write_text("", encoding="utf-8")
    assert not is_up_to_date(copy, seed=0)
    assert main(["--out", str(copy), "--seed", "0", "--force"]) == 0
    assert "up to date" not in capsys.readouterr().out
    assert is_up_to_date(copy, seed=0)
    assert all((copy / name).read_bytes() == (out / name).read_bytes() for name in ALL_FILES)
