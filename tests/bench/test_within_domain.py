"""bench.studies.within_domain: window features against brute force, and a known preference read back from a ledger."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from bench.studies.within_domain import domain_scales, run_preferences, sample_features
from selection_callbacks.core.ledger_store import SCHEMA, write_table
from selection_callbacks.data.packing import pack_source
from selection_callbacks.data.tokenizer import ByteTokenizer

T = 32
BOS = ByteTokenizer.bos_id


@pytest.fixture(scope="module")
def split(tiny_corpus, tmp_path_factory):
    return pack_source(tiny_corpus["pool"], T, tmp_path_factory.mktemp("cache"), progress=False)


def test_features_match_brute_force(split) -> None:
    ids = np.arange(0, 60, 7)
    got = sample_features(split, ids, BOS)
    for row, s in enumerate(ids):
        window = split.tokens[s * T : s * T + T + 1].astype(int).tolist()
        text = bytes(t for t in window if t < 256)
        start = s * T
        doc = max(i for i, d in enumerate(split.doc_start) if d <= start)
        end = split.doc_start[doc + 1] if doc + 1 < len(split.doc_start) else len(split.tokens)
        assert got["boundaries"][row] == window.count(BOS)
        assert got["distinct"][row] == len(set(window))
        assert got["whitespace"][row] == pytest.approx(sum(c in b" \t\n\r" for c in text) / max(len(text), 1))
        assert got["digits"][row] == pytest.approx(sum(c in b"0123456789" for c in text) / max(len(text), 1))
        assert got["doc_offset"][row] == pytest.approx(np.log2(1 + start - split.doc_start[doc]))
        assert got["doc_length"][row] == pytest.approx(np.log2(end - split.doc_start[doc]))


def _ledger(run_dir: Path, split, keep: str, records: int = 30, n: int = 8) -> None:
    """A ledger whose selections keep, in each micro-batch and domain, the half with the most (or least) whitespace."""
    rng = np.random.default_rng(0)
    rows = {name: [] for name in SCHEMA.names}
    for r in range(records):
        ids = rng.choice(len(split), n, replace=False)
        white = sample_features(split, ids, BOS)["whitespace"]
        domain = split.sample_domain[ids]
        selected = np.zeros(n, dtype=bool)
        for code in np.unique(domain):
            members = np.flatnonzero(domain == code)
            order = members[np.argsort(white[members])]
            chosen = order[len(order) // 2 :] if keep == "most" else order[: len(order) // 2]
            selected[chosen] = True
        for pos, (s, kept, code) in enumerate(zip(ids, selected, domain)):
            for key, value in (("record", r), ("step", r), ("epoch", 0), ("micro_batch", r), ("rank", 0), ("world_size", 1),
                               ("position", pos), ("sample_id", int(s)), ("score", 0.0), ("selected", bool(kept)),
                               ("domain", split.domain_names[code])):
                rows[key].append(value)
    (run_dir / "ledger").mkdir(parents=True)
    write_table(pa.table(rows, schema=SCHEMA), run_dir / "ledger" / "rank0-00000.parquet")


def test_a_known_within_domain_preference_is_read_back(split, tmp_path: Path) -> None:
    scales = domain_scales(split, BOS)
    for keep, sign in (("most", 1), ("least", -1)):
        _ledger(tmp_path / keep, split, keep)
        prefs = run_preferences(tmp_path / keep, split, scales, BOS)
        assert sign * prefs["whitespace"] > 0.5, prefs
