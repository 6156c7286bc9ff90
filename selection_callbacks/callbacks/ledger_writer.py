"""``SelectionLedger``: every candidate's score and fate, per micro-batch, as parquet shards.

The files and their readers are in :mod:`selection_callbacks.core.ledger_store`;
``selection-callbacks ledger`` exports the selected ids as a subset file and summarises a run.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import pyarrow as pa
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from selection_callbacks.callbacks.base import SelectionCallback
from selection_callbacks.core.domains import domain_names
from selection_callbacks.core.io import write_json_atomic
from selection_callbacks.core.ledger_store import SCHEMA, LedgerError, next_seq, truncate_ledger, write_table
from selection_callbacks.core.selection import SelectionRecord


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
        self._seq = next_seq(self._folder, rank)
        self._buffer.clear()
        datamodule = getattr(trainer, "datamodule", None)
        names = getattr(datamodule, "domain_names", None)
        self._domain_names = list(names) if names is not None else None
        if trainer.is_global_zero:
            write_json_atomic(self._folder / "meta.json", {"world_size": world, **_pool_source(datamodule)})

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
            columns["domain"] = np.array(domain_names(record.domain[own].tolist(), self._domain_names), dtype=object)
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
        write_table(pa.table(columns, schema=SCHEMA), path)
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


def _pool_source(datamodule: Any) -> dict[str, Any]:
    """Where the candidates came from (a ``PoolDataModule``'s pool, T, cache, subset, tokenizer file and
    columns), for doc-level views."""
    paths = getattr(datamodule, "paths", None)
    if not isinstance(paths, dict) or "pool" not in paths:
        return {}
    cache = getattr(datamodule, "cache_dir", None)
    tokenizer = getattr(datamodule, "tokenizer", None)
    columns = getattr(datamodule, "columns", None)
    return {
        "pool": str(paths["pool"]),
        "seq_len": getattr(datamodule, "seq_len", None),
        "cache_dir": str(cache) if cache is not None else None,
        "subset": getattr(datamodule, "subset_path", None),
        "tokenizer": str(tokenizer.path) if hasattr(tokenizer, "path") else None,
        "boundary_token": getattr(tokenizer, "boundary_token", None),
        "columns": dataclasses.asdict(columns) if dataclasses.is_dataclass(columns) else None,
    }
