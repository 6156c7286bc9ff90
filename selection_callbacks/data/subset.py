"""Subset files: parquet with a ``doc_id`` or ``sample_id`` column and an optional ``weight``.

``weight`` is a repeat count per epoch (fractions are rounded stochastically, seeded, with the
epoch's total fixed at ⌊Σw⌋ or ⌈Σw⌉), so the ledger's "selected ids with counts" export trains
as written. Duplicate ids add their weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class Subset:
    """Ids of one kind (``doc_id`` or ``sample_id``) with optional per-id weights."""

    kind: str
    ids: list
    weights: np.ndarray | None = None


class SubsetError(ValueError):
    """A subset file that cannot be used."""


def read_subset(path: str | Path) -> Subset:
    """Read and validate a subset file."""
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow raises several types for missing or corrupt files
        raise SubsetError(f"cannot read subset file {str(path)!r}: {e}") from e
    cols = table.column_names
    kind = "sample_id" if "sample_id" in cols else "doc_id" if "doc_id" in cols else None
    if kind is None:
        raise SubsetError(f"subset file {str(path)!r} needs a 'doc_id' or 'sample_id' column, found {cols}")
    ids = table.column(kind).to_pylist()
    if not ids:
        raise SubsetError(f"subset file {str(path)!r} is empty")
    if kind == "doc_id":
        ids = [str(i) for i in ids]
    elif any(not isinstance(i, int) or i < 0 for i in ids):
        raise SubsetError(f"subset file {str(path)!r}: 'sample_id' must be non-negative integers")
    weights = None
    if "weight" in cols:
        weights = np.asarray(table.column("weight").to_pylist(), dtype=np.float64)
        if not np.all(np.isfinite(weights)) or np.any(weights < 0) or weights.sum() <= 0:
            raise SubsetError(f"subset file {str(path)!r}: 'weight' must be finite, ≥ 0 and not all zero")
    return Subset(kind=kind, ids=ids, weights=weights)


def write_subset(path: str | Path, kind: str, ids: list, weights: np.ndarray | None = None) -> Path:
    """Write a subset file; ``kind`` is ``'doc_id'`` or ``'sample_id'``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if kind not in ("doc_id", "sample_id"):
        raise SubsetError(f"subset kind must be 'doc_id' or 'sample_id', got {kind!r}")
    cols = {kind: pa.array([str(i) for i in ids] if kind == "doc_id" else [int(i) for i in ids])}
    if weights is not None:
        cols["weight"] = pa.array(np.asarray(weights, dtype=np.float64))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(cols), path)
    return path


def repeat_counts(weights: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Integer repeat counts with E[count_i] = weight_i and a total of ⌊Σw⌋ or ⌈Σw⌉.

    Systematic rounding: count_i = ⌊C_i + u⌋ − ⌊C_{i−1} + u⌋ with C the cumulative weights and
    one u ~ U[0, 1), so an epoch never holds fewer than ⌊Σw⌋ sequences.
    """
    edges = np.floor(np.concatenate([[0.0], np.cumsum(weights)]) + rng.random())
    return np.diff(edges).astype(np.int64)
