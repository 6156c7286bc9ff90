"""The stages' per-shard feature tables: the tasks that write them and the readers the selectors use.

``count`` tables hold id, domain and :func:`stages.count_columns`' columns, with the shard's byte and
DSIR bucket totals in the parquet metadata; ``score`` tables hold ``log_freq`` and ``dsir_logw``;
``embed`` tables hold one ``embedding`` list<float32>[d] per document. Readers concatenate shards
in order, so row i is pool document i, and never read the pool's text.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from selection_callbacks.offline.common.corpus import SelectionError
from selection_callbacks.offline.sharded.stages import count_columns, embed_columns, score_columns

__all__ = ["TableIndex", "count_task", "embed_task", "read_columns", "read_embeddings", "read_index",
           "read_totals", "score_task"]


def count_task(texts: list[str], seq_len: int, num_buckets: int) -> pa.Table:
    """Stage ``count``: per-document cheap columns; the shard's totals in the metadata."""
    cols, totals = count_columns(texts, seq_len, num_buckets)
    table = pa.table({k: pa.array(v) for k, v in cols.items()})
    return table.replace_schema_metadata({"totals": json.dumps({k: v.tolist() for k, v in totals.items()})})


def score_task(texts: list[str], byte_logp: np.ndarray, dsir_ratio: np.ndarray) -> pa.Table:
    """Stage ``score``: ``log_freq`` and ``dsir_logw`` under the global statistics."""
    return pa.table({k: pa.array(v) for k, v in score_columns(texts, byte_logp, dsir_ratio).items()})


def embed_task(texts: list[str]) -> pa.Table:
    """Stage ``embed``: hashed n-gram embeddings."""
    emb = embed_columns(texts)
    return pa.table({"embedding": pa.FixedSizeListArray.from_arrays(pa.array(emb.reshape(-1)), emb.shape[1])})


@dataclass(frozen=True)
class TableIndex:
    """A pool's rows without their text: ids [D], domains [D], int64 n_tokens [D], int64 n_chars [D]."""

    ids: np.ndarray
    domains: np.ndarray
    n_tokens: np.ndarray
    n_chars: np.ndarray

    def __len__(self) -> int:
        return int(self.ids.size)


def read_columns(paths: list[Path], names: list[str]) -> dict[str, np.ndarray]:
    """The named columns of every shard's table, concatenated in shard order."""
    tables = [pq.read_table(p, columns=names) for p in paths]
    return {n: np.concatenate([t.column(n).to_numpy() for t in tables]) for n in names}


def read_index(count_paths: list[Path], id_paths: list[Path]) -> TableIndex:
    """Ids and domains from the pool shards' id columns, lengths from the ``count`` tables; repeated ids are an error."""
    ids = read_columns(id_paths, ["id", "domain"])
    lengths = read_columns(count_paths, ["n_tokens", "n_chars"])
    uniq, counts = np.unique(ids["id"], return_counts=True)
    if (counts > 1).any():
        raise SelectionError(f"the pool repeats document ids (e.g. {uniq[counts > 1][:3].tolist()}); "
                             "a doc_id subset needs unique ids")
    return TableIndex(ids["id"].astype(str), ids["domain"].astype(str), lengths["n_tokens"].astype(np.int64),
                      lengths["n_chars"].astype(np.int64))


def read_totals(paths: list[Path]) -> dict[str, np.ndarray]:
    """Shard totals of the ``count`` tables summed (int64, exact)."""
    out: dict[str, np.ndarray] = {}
    for p in paths:
        for k, v in json.loads(pq.read_schema(p).metadata[b"totals"]).items():
            out[k] = out.get(k, 0) + np.asarray(v, dtype=np.int64)
    return out


def read_embeddings(paths: list[Path]) -> np.ndarray:
    """float32 [D, d] of the ``embed`` tables."""
    parts = []
    for p in paths:
        col = pq.read_table(p, columns=["embedding"]).column("embedding").combine_chunks()
        parts.append(col.values.to_numpy().reshape(len(col), col.type.list_size))
    return np.concatenate(parts)
