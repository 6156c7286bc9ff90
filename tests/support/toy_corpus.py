"""Small deterministic documents the test suite trains on (``tiny_corpus`` in tests/conftest.py): word prose or
random printable noise. ``bench.studies.utility_ranking`` trains on them too, so its states are those of
tests/scoring/test_maps.py."""

from __future__ import annotations

import random

WORDS = "the model reads data and learns which tokens follow from the context it has seen before".split()


def make_docs(prefix: str, n: int, seed: int, domains: tuple[str, ...] = ("prose", "noise"), length: int = 400) -> list[dict]:
    """``n`` rows ``{"id", "text", "domain"}``, domains in turn: prose of ``WORDS`` or ``length`` printable noise characters."""
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
