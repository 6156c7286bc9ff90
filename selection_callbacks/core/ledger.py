"""``SelectionLedger``: every candidate's score and fate, per micro-batch, as parquet shards.

Layout of ``<run_dir>/ledger/``: ``rank{r}-{seq:05d}.parquet`` shards (rank ``r`` writes the
rows of its own candidates) and ``meta.json`` (where the pool came from, for doc-level views).
:func:`read_ledger` joins the shards in training order; ``python -m selection_callbacks.ledger``
exports the selected ids as a subset file and summarises a run.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from selection_callbacks.core.callback import SelectionCallback, SelectionRecord

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
_SHARD_TMP = re.compile(r"rank(\d+)-(\d+)\.tmp\d+")


class LedgerError(RuntimeError):
    """A ledger folder that is missing or cannot be read."""


class SelectionLedger(L.Callback):
    """Writes one parquet row per candidate per micro-batch: ids, scores and whether it was kept.

    It reads the :class:`SelectionCallback`'s ``last_record`` in ``on_train_batch_end`` (so
    callback order does not matter). Every rank holds the same global record and writes only
    the rows of its own candidates, so no collective is needed. Rows are buffered in memory and
    written as a new shard at every checkpoint (``state_dict``), every ``flush_every``
    micro-batches, at the end of training and on an exception.

    The checkpoint stores how many micro-batches were recorded. When training starts the ledger
    is truncated to that count: rows written after the checkpoint (by a periodic flush of a run
    that was then killed) are removed from the shards, and a fresh run (no checkpoint) clears a
    previous run's ledger in the same folder. Resume therefore never leaves duplicates or gaps.

    Example::

        trainer = L.Trainer(callbacks=[HighLossSelection(0.5), SelectionLedger("runs/demo")])
        trainer.fit(model, datamodule=dm)
        table = read_ledger("runs/demo")  # pyarrow.Table, columns in ``SCHEMA``

    Args:
        run_dir: the run folder; shards go to ``<run_dir>/ledger/`` (default: the trainer's
            ``default_root_dir``).
        flush_every: also write a shard every this many micro-batches (None: only at
            checkpoints, at the end and on an exception).
        enabled: ``False`` records nothing (train.py's ``--ledger.enabled false``).
    """

    def __init__(self, run_dir: str | None = None, flush_every: int | None = 1000, enabled: bool = True) -> None:
        if flush_every is not None and flush_every < 1:
            raise ValueError(f"flush_every must be ≥ 1 or None, got {flush_every}")
        self.run_dir, self.flush_every, self.enabled = run_dir, flush_every, enabled
        self.records = 0  # micro-batches recorded this run (buffered or on disk)
        self._buffer: list[dict[str, np.ndarray]] = []
        self._selector: SelectionCallback | None = None
        self._last: SelectionRecord | None = None
        self._folder: Path | None = None
        self._rank = 0
        self._seq = 0
        self._domain_names: list[str] | None = None

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if not self.enabled or stage != "fit":
            return
        self._selector = next((c for c in trainer.callbacks if isinstance(c, SelectionCallback)), None)
        if self._selector is None:
            rank_zero_warn("SelectionLedger: no SelectionCallback among the trainer's callbacks; it records nothing")
        self._folder = Path(self.run_dir or trainer.default_root_dir) / "ledger"
        self._rank = trainer.global_rank

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self._active:
            return
        assert self._folder is not None
        self._folder.mkdir(parents=True, exist_ok=True)
        rank, world = self._rank, trainer.world_size
        owned = (lambda r: r == rank) if rank else (lambda r: r == 0 or r >= world)  # rank 0 clears wider runs' ranks
        removed = truncate_ledger(self._folder, self.records, owned)
        if trainer.global_step > 0 and self.records == 0:
            rank_zero_warn(
                f"SelectionLedger: the checkpoint holds no ledger state; the ledger restarts at step {trainer.global_step}"
            )
        elif removed and self.records == 0:
            rank_zero_warn(f"SelectionLedger: removed {removed} rows of an earlier run from {self._folder}")
        self._seq = _next_seq(self._folder, rank)
        self._buffer.clear()
        datamodule = getattr(trainer, "datamodule", None)
        names = getattr(datamodule, "domain_names", None)
        self._domain_names = list(names) if names is not None else None
        if trainer.is_global_zero:
            _write_json(self._folder / "meta.json", {"world_size": world, **_pool_source(datamodule)})

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        if not self._active:
            return
        assert self._selector is not None
        record = self._selector.last_record
        if record is None or record is self._last:
            raise LedgerError(
                f"SelectionLedger: {type(self._selector).__name__} made no selection for batch {batch_idx}; "
                "the ledger needs one SelectionRecord per micro-batch"
            )
        self._last = record
        self._buffer.append(self._rows(record))
        self.records += 1
        if self.flush_every is not None and len(self._buffer) >= self.flush_every:
            self.flush()

    def _rows(self, record: SelectionRecord) -> dict[str, np.ndarray]:
        """This rank's rows of one record, as column arrays."""
        g = record.scores.shape[0]
        n = g // record.world_size
        own = slice(self._rank * n, (self._rank + 1) * n)
        selected = record.selected_mask.numpy()[own]
        columns = {
            "record": np.full(n, self.records, dtype=np.int64),
            "step": np.full(n, record.step, dtype=np.int64),
            "epoch": np.full(n, record.epoch, dtype=np.int32),
            "micro_batch": np.full(n, record.micro_batch, dtype=np.int64),
            "rank": record.rank_of[own].numpy().astype(np.int32),
            "world_size": np.full(n, record.world_size, dtype=np.int32),
            "position": np.arange(own.start, own.stop, dtype=np.int32),
            "sample_id": record.sample_id[own].numpy().astype(np.int64) if record.sample_id is not None else None,
            "score": record.scores[own].numpy().astype(np.float32),
            "selected": selected,
            "domain": None,
        }
        if record.domain is not None:
            codes = record.domain[own].tolist()
            names = self._domain_names
            columns["domain"] = np.array(
                [names[c] if names is not None and 0 <= c < len(names) else str(c) for c in codes], dtype=object
            )
        return columns

    def flush(self) -> Path | None:
        """Write the buffered rows as this rank's next shard; its path (None when nothing was buffered)."""
        if not self._buffer or self._folder is None:
            return None
        columns = {}
        for field in SCHEMA:
            parts = [rows[field.name] for rows in self._buffer]
            columns[field.name] = (
                pa.nulls(sum(len(rows["record"]) for rows in self._buffer), field.type)
                if any(p is None for p in parts)
                else pa.array(np.concatenate(parts), field.type)
            )
        path = self._folder / f"rank{self._rank}-{self._seq:05d}.parquet"
        _write_table(pa.table(columns, schema=SCHEMA), path)
        self._buffer.clear()
        self._seq += 1
        return path

    @property
    def _active(self) -> bool:
        return self.enabled and self._selector is not None

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._active:
            self.flush()

    @override
    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        if self._active:  # the rows up to the crash, for inspection; a resume truncates them to its checkpoint
            self.flush()

    @override
    def state_dict(self) -> dict[str, Any]:
        """Flushes first, so the checkpoint covers exactly the ``records`` micro-batches on disk."""
        if self._active:
            self.flush()
        return {"records": self.records}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.records = int(state_dict["records"])


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
        keep = _read_shard(path, ["record"]).column("record").to_numpy() < keep_records
        if keep.all():
            continue
        removed += int((~keep).sum())
        if keep.any():
            _write_table(_read_shard(path).filter(pa.array(keep)), path)
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
    table = pa.concat_tables([_read_shard(p) for p in shards])
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


def _read_shard(path: Path, columns: list[str] | None = None) -> pa.Table:
    """One shard (or some of its columns), checked against ``SCHEMA``."""
    try:
        table = pq.read_table(path, columns=columns)
    except Exception as e:  # pyarrow raises several types for missing or corrupt files
        raise LedgerError(f"cannot read ledger shard {str(path)!r}: {e}") from e
    expected = pa.schema([SCHEMA.field(c) for c in columns or SCHEMA.names])
    if table.schema.names != expected.names:
        raise LedgerError(f"ledger shard {str(path)!r} has columns {table.schema.names}, expected {expected.names}")
    return table.cast(expected)


def _next_seq(folder: Path, rank: int) -> int:
    seqs = [int(m.group(2)) for p in folder.glob(f"rank{rank}-*.parquet") if (m := _SHARD.fullmatch(p.name))]
    return max(seqs, default=-1) + 1


def _write_table(table: pa.Table, path: Path) -> None:
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    pq.write_table(table, tmp)
    tmp.replace(path)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2))
    tmp.replace(path)


def _pool_source(datamodule: Any) -> dict[str, Any]:
    """Where the candidates came from (a ``PoolDataModule``'s pool, T, cache and subset), for doc-level views."""
    paths = getattr(datamodule, "paths", None)
    if not isinstance(paths, dict) or "pool" not in paths:
        return {}
    cache = getattr(datamodule, "cache_dir", None)
    return {
        "pool": str(paths["pool"]),
        "seq_len": getattr(datamodule, "seq_len", None),
        "cache_dir": str(cache) if cache is not None else None,
        "subset": getattr(datamodule, "subset_path", None),
    }
