"""A larger pool drawn from a smaller one: random spans of random documents, until a byte total is met.

Each new document is a contiguous span of a source document drawn uniformly at random (with
replacement): its length is a uniform share u ∈ [``min_share``, 1] of the source's characters, its
start uniform among the positions that fit, both moved to the next whitespace so that words stay
whole. A new document keeps its source's domain and group (so held-out splits stay disjoint from
it) and gets the id ``<source id>~<k>``; exact repeats of a text are drawn again. Domains keep
their document shares in expectation, so a selector meets the same mix at a larger scale.

Example::

    big = resample_pool(splits["pool"], megabytes=112, seed=0)   # ≈ 40k documents from the default 1.9k
"""

from __future__ import annotations

import dataclasses
import random
import re
from collections.abc import Sequence
from typing import Any

__all__ = ["resample_pool"]

_SPACE = re.compile(r"\s")


def _snap(text: str, i: int) -> int:
    """The first whitespace position at or after ``i`` (len(text) when none)."""
    m = _SPACE.search(text, i)
    return len(text) if m is None else m.start()


def _span(text: str, rng: random.Random, min_share: float) -> str:
    n = len(text)
    length = max(1, round(rng.uniform(min_share, 1.0) * n))
    start = rng.randint(0, n - length)
    a = 0 if start == 0 else min(_snap(text, start) + 1, n)
    b = _snap(text, start + length) if start + length < n else n
    return text[a:b].strip() or text


def resample_pool(pool: Sequence[Any], megabytes: float, seed: int, min_share: float = 0.5) -> list[Any]:
    """Documents (dataclasses with ``id`` and ``text``) resampled until their UTF-8 bytes reach ``megabytes``·10⁶."""
    if not pool:
        raise ValueError("resample_pool needs at least one source document")
    if megabytes <= 0 or not 0.0 < min_share <= 1.0:
        raise ValueError(f"need megabytes > 0 and min_share in (0, 1], got {megabytes}, {min_share}")
    rng = random.Random(f"{seed}/resample")
    target, total, seen, out = megabytes * 1e6, 0, set(), []
    drawn: dict[str, int] = {}
    misses = 0
    while total < target:
        src = pool[rng.randrange(len(pool))]
        text = _span(src.text, rng, min_share)
        if text in seen:
            misses += 1
            if misses > 100 * len(pool):
                raise ValueError(f"{len(pool)} source documents cannot give {megabytes} MB of distinct spans")
            continue
        seen.add(text)
        k = drawn[src.id] = drawn.get(src.id, 0) + 1
        out.append(dataclasses.replace(src, id=f"{src.id}~{k}", text=text))
        total += len(text.encode("utf-8"))
    return out
