"""The resampled pool: spans of source documents up to a byte total, built by ``corpus --pool-mb``."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest

from selection_callbacks.data.corpus_docs import SPLIT_FILES
from selection_callbacks.data.default_corpus import is_up_to_date, main
from selection_callbacks.data.resampled_pool import resample_pool


@dataclass(frozen=True)
class _Doc:
    id: str
    text: str
    domain: str


SOURCES = [
    _Doc(f"{d}{i}", " ".join(f"{d}{i}w{j}" for j in range(200)), d) for d in ("a", "b") for i in range(5)
]


def test_spans_reach_the_byte_total_and_keep_words_whole() -> None:
    out = resample_pool(SOURCES, megabytes=0.05, seed=0)
    sizes = [len(d.text.encode()) for d in out]
    assert sum(sizes) >= 50_000 and sum(sizes) - sizes[-1] < 50_000  # stops at the first draw past the total
    by_id = {d.id: d for d in SOURCES}
    assert len({d.id for d in out}) == len(out) and len({d.text for d in out}) == len(out)
    for d in out:
        src = by_id[d.id.split("~")[0]]
        assert d.domain == src.domain and d.text in src.text
        words = d.text.split(" ")
        assert set(words) <= set(src.text.split(" "))  # spans start and end on whole words
        assert len(d.text) >= 0.5 * len(src.text) - 20  # u ≥ min_share, less the snapping to word ends
    shares = Counter(d.domain for d in resample_pool(SOURCES, 0.5, seed=0))
    n = shares["a"] + shares["b"]
    assert abs(shares["a"] - shares["b"]) < 4 * n**0.5  # sources are drawn uniformly: within 4 sd of n/2 each
    assert resample_pool(SOURCES, 0.05, seed=0) == out
    assert resample_pool(SOURCES, 0.05, seed=1) != out


def test_bad_requests_are_errors() -> None:
    with pytest.raises(ValueError, match="at least one source"):
        resample_pool([], 1.0, 0)
    with pytest.raises(ValueError, match="megabytes > 0"):
        resample_pool(SOURCES, 0.0, 0)
    with pytest.raises(ValueError, match="distinct spans"):
        resample_pool([_Doc("x", "tiny", "a")], 1.0, 0)


def test_corpus_command_resamples_the_pool_only(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "large"
    assert main(["--out", str(out), "--pool-mb", "12"]) == 0
    card = json.loads((out / "card.json").read_text())
    pool = [json.loads(line) for line in (out / SPLIT_FILES["pool"]).read_text().splitlines()]
    held = [json.loads(line) for s in ("target", "val") for line in (out / SPLIT_FILES[s]).read_text().splitlines()]
    assert card["pool_mb"] == 12 and sum(len(d["text"].encode()) for d in pool) >= 12e6
    assert all("~" in d["id"] for d in pool) and not {d["text"] for d in pool} & {d["text"] for d in held}
    assert is_up_to_date(out, 0, 12) and not is_up_to_date(out, 0) and not is_up_to_date(out, 0, 24)
    capsys.readouterr()
    assert main(["--out", str(out), "--pool-mb", "12"]) == 0
    assert "up to date" in capsys.readouterr().out
