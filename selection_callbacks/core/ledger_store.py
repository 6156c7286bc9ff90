"""The ledger's files: one parquet row per candidate per micro-batch, in shards per rank.

Layout of ``<run_dir>/ledger/``: ``rank{r}-{seq:05d}.parquet`` shards (rank ``r`` writes the
rows of its own candidates) and ``meta.json`` (where the pool came from, for doc-level views).
:func:`read_ledger` joins the shards in training order; :func:`truncate_ledger` cuts them back
to a checkpoint. The callback that writes them is ``selection_callbacks.callbacks.ledger_writer``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from selection_callbacks.core.io import atomic_path

SCHEMA = pa.schema(
    [
        ("record", pa.int64()),  # the micro-batch's index among the run's selections (0, 1, …)
        ("step", pa.int64()),  # trainer.global_step at selection
        ("epoch", pa.int32()),
        ("micro_batch", pa.int64()),  # batch index within the epoch
        ("rank", pa.int32()),  # the rank that drew the candidate
        ("world_size", pa.int32()),
        ("position", pa.int32()),  # index in the global superbatch of W·N (rank r holds r·N … r·N+N−1)
        ("sample_id", pa.int64()),  # null when batches carry no ids
        ("score", pa.float32()),  # the score the sampling rule saw
        ("selected", pa.bool_()),  # kept by any rank
        ("domain", pa.string()),  # domain name (or code when the datamodule has no names); null without domains
    ]
)
_SHARD = re.compile(r"rank(\d+)-(\d+)\.parquet")
_SHARD_TMP = re.compile(r"rank(\d+)-(\d+)(?:\.parquet)?\.tmp\d+")


class LedgerError(RuntimeError):
    """A ledger folder that is missing or cannot be read."""


def truncate_ledger(folder: str | Path, keep_records: int, ranks: Callable[[int], bool] | None = None) -> int:
    """Remove rows with ``record ≥ keep_records`` from the shards in ``folder``; the number removed.

    Args:
        folder: the ledger folder.
        keep_records: micro-batches to keep (a checkpoint's ``records``; 0 clears the ledger).
        ranks: which ranks' shards to truncate (default: all).
    """
    removed = 0
    for path in sorted(Path(folder).iterdir()):
        match = _SHARD.fullmatch(path.name) or _SHARD_TMP.fullmatch(path.name)
        if match is None or (ranks is not None and not ranks(int(match.group(1)))):
            continue
        if path.suffix != ".parquet":  # a shard write interrupted by a kill
            path.unlink()
            continue
        keep = read_shard(path, ["record"]).column("record").to_numpy() < keep_records
        if keep.all():
            continue
        removed += int((~keep).sum())
        if keep.any():
            write_table(read_shard(path).filter(pa.array(keep)), path)
        else:
            path.unlink()
    return removed


def read_ledger(run_dir: str | Path) -> pa.Table:
    """All shards of a run (``run_dir`` or its ``ledger`` folder), sorted by record then position.

    The order is training order (step, micro-batch), then rank and position in the global superbatch.
    """
    folder = ledger_folder(run_dir)
    shards = sorted(p for p in folder.glob("*.parquet") if _SHARD.fullmatch(p.name))
    if not shards:
        raise LedgerError(f"ledger folder {str(folder)!r} holds no shards (rank*-*.parquet)")
    table = pa.concat_tables([read_shard(p) for p in shards])
    return table.sort_by([("record", "ascending"), ("position", "ascending")])


def read_meta(run_dir: str | Path) -> dict[str, Any]:
    """The ledger's ``meta.json`` (world size and the pool's source), ``{}`` when absent."""
    path = ledger_folder(run_dir) / "meta.json"
    return json.loads(path.read_text()) if path.exists() else {}


def ledger_folder(run_dir: str | Path) -> Path:
    """``run_dir/ledger``, or ``run_dir`` itself when it is a ledger folder."""
    run_dir = Path(run_dir)
    for folder in (run_dir / "ledger", run_dir):
        if folder.is_dir() and (any(folder.glob("rank*-*.parquet")) or (folder / "meta.json").exists()):
            return folder
    raise LedgerError(
        f"no ledger in {str(run_dir)!r}: expected {str(run_dir / 'ledger')!r} with rank*-*.parquet shards "
        "(train with the SelectionLedger callback; train.py records one unless --ledger.enabled false)"
    )


def read_shard(path: Path, columns: list[str] | None = None) -> pa.Table:
    """One shard (or some of its columns), checked against ``SCHEMA``."""
    try:
        table = pq.read_table(path, columns=columns)
    except Exception as e:  # pyarrow raises several types for missing or corrupt files
        raise LedgerError(f"cannot read ledger shard {str(path)!r}: {e}") from e
    expected = pa.schema([SCHEMA.field(c) for c in columns or SCHEMA.names])
    if table.schema.names != expected.names:
        raise LedgerError(f"ledger shard {str(path)!r} has columns {table.schema.names}, expected {expected.names}")
    return table.cast(expected)


def next_seq(folder: Path, rank: int) -> int:
    seqs = [int(m.group(2)) for p in folder.glob(f"rank{rank}-*.parquet") if (m := _SHARD.fullmatch(p.name))]
    return max(seqs, default=-1) + 1


def write_table(table: pa.Table, path: Path) -> None:
    """One shard, atomically (an interrupted write leaves ``<shard>.tmp<pid>``, which truncation removes)."""
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp)
