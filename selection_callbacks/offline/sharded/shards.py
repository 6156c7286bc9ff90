"""The pool as parquet shards: ``shard-00000.parquet`` … of columns id, domain, text, in pool order.

Shard k holds documents [k·D/N, (k+1)·D/N) (integer division), so the shards concatenated are the
pool. The split is written once per work folder; ``pool.json`` beside it records the source files
(path, size, mtime) and the rows per shard, and a rerun with the same pool and shard count reuses it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from selection_callbacks.core.io import atomic_path, write_json_atomic
from selection_callbacks.data.readers import iter_documents, source_files
from selection_callbacks.offline.common.corpus import SelectionError

__all__ = ["PoolShards", "file_fingerprint", "shard_pool"]

SCHEMA = pa.schema([("id", pa.string()), ("domain", pa.string()), ("text", pa.string())])


@dataclass(frozen=True)
class PoolShards:
    """Where a pool's shards lie.

    Attributes:
        root: the folder holding ``shard-*.parquet`` and ``pool.json``.
        rows: documents per shard, shard order.
    """

    root: Path
    rows: tuple[int, ...]

    def __len__(self) -> int:
        return len(self.rows)

    def path(self, k: int) -> Path:
        return self.root / f"shard-{k:05d}.parquet"

    def texts(self, k: int) -> list[str]:
        """The text column of shard ``k``."""
        return pq.read_table(self.path(k), columns=["text"]).column("text").to_pylist()


def file_fingerprint(source: str | Path) -> list[dict]:
    """Path, size and mtime of every file of a source: what a written result was computed from."""
    return [{"path": str(f.resolve()), "size": f.stat().st_size, "mtime_ns": f.stat().st_mtime_ns}
            for f in source_files(source)]


def shard_pool(pool: str | Path, root: str | Path, n_shards: int) -> PoolShards:
    """Split ``pool`` (any format :func:`iter_documents` reads) into ``n_shards`` parquet shards under ``root``.

    Two streaming passes (count, then write); only one shard's documents are held at a time.
    """
    if n_shards < 1:
        raise SelectionError(f"--shards must be ≥ 1, got {n_shards}")
    root = Path(root)
    record = root / "pool.json"
    source = {"pool": str(pool), "files": file_fingerprint(pool), "shards": n_shards}
    if record.exists():
        done = json.loads(record.read_text())
        if done["source"] == source:
            return PoolShards(root, tuple(done["rows"]))
        raise SelectionError(f"{root} holds shards of another pool or shard count ({done['source']['pool']!r}, "
                             f"{done['source']['shards']} shards); give a fresh work folder or delete it")
    total = sum(1 for _ in iter_documents(pool))
    if total == 0:
        raise SelectionError(f"pool {str(pool)!r} holds no documents: nothing to select from")
    if n_shards > total:
        raise SelectionError(f"--shards {n_shards} is more than the pool's {total} documents; use at most {total}")
    bounds = [k * total // n_shards for k in range(n_shards + 1)]
    root.mkdir(parents=True, exist_ok=True)
    docs = iter_documents(pool)
    for k in range(n_shards):
        rows = [next(docs) for _ in range(bounds[k + 1] - bounds[k])]
        table = pa.table({"id": [d.id for d in rows], "domain": [d.domain for d in rows],
                          "text": [d.text for d in rows]}, schema=SCHEMA)
        with atomic_path(root / f"shard-{k:05d}.parquet", ".parquet") as tmp:
            pq.write_table(table, tmp)
    rows_per = tuple(b - a for a, b in zip(bounds, bounds[1:]))
    write_json_atomic(record, {"source": source, "rows": list(rows_per)})
    return PoolShards(root, rows_per)
