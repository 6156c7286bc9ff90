"""Run a per-shard task over every shard of the pool as Ray Data map tasks, resumably.

Each stage writes ``<work>/<stage>-<hash>/shard-00000.parquet`` … : a task reads its pool shard, computes a
table and writes it atomically (a temporary sibling renamed into place), and the driver records the
shard in the stage's ``manifest.json`` (atomically) as its result arrives. A rerun skips the shards
the manifest holds, so a killed run restarts from the shards already written; tasks are pure
functions of their shard and the stage's settings (which name the stage's folder,
``<work>/<stage>-<hash>``), so the result equals an uninterrupted run's.

Ray runs as a local cluster of ``workers`` CPUs (no dashboard) unless ``address`` names a running
cluster, or Ray is already initialised (then that session is used and left running). Per stage the
engine records the wall seconds and, per worker process, shards, task seconds and peak resident
memory (the worker's high-water mark, reset at the start of each task).

Example::

    with ShardedEngine(Path("runs/work"), workers=2) as engine:
        paths = engine.run_stage("count", count_task, shards, {"seq_len": 128}, {"seq_len": 128})
    engine.summary()        # {"count": {"seconds": ..., "workers": {"pid 123": {...}}}, ...}
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from tqdm.auto import tqdm

from selection_callbacks.core.costs import peak_rss_mb, reset_peak_rss
from selection_callbacks.core.io import atomic_path, write_json_atomic
from selection_callbacks.offline.common.corpus import SelectionError
from selection_callbacks.offline.sharded.shards import PoolShards

__all__ = ["ShardTask", "ShardedEngine"]

ShardTask = Callable[..., pa.Table]
"""``task(texts: list[str], **kwargs) -> pa.Table``: one row per document of the shard, in its order."""


def _run_shard(row: dict[str, Any], task: ShardTask, kwargs: dict[str, Any]) -> dict[str, Any]:
    """One map task: read the shard's text, compute its table, write it atomically; what it cost."""
    reset_peak_rss()
    start = time.perf_counter()
    texts = pq.read_table(row["source"], columns=["text"]).column("text").to_pylist()
    table = task(texts, **kwargs)
    if table.num_rows != len(texts):
        raise RuntimeError(f"stage task {task.__name__} gave {table.num_rows} rows for {len(texts)} documents")
    out = Path(row["out"])
    with atomic_path(out, ".parquet") as tmp:
        pq.write_table(table, tmp)
    return {"shard": row["shard"], "rows": len(texts), "seconds": round(time.perf_counter() - start, 3),
            "peak_rss_mb": round(peak_rss_mb(), 1), "worker": f"{socket.gethostname()}:{os.getpid()}"}


@dataclass
class ShardedEngine:
    """Stages over pool shards on Ray Data.

    Attributes:
        work_dir: where shards, stage tables and manifests go (reused by a rerun: resume).
        workers: map tasks at a time (and the local cluster's CPUs).
        address: a running Ray cluster (``ray://…`` or ``host:port``); None starts a local one.
        progress: a bar per stage.
        after_shard: called as ``after_shard(stage, shard)`` once a shard is recorded (progress hooks).
    """

    work_dir: Path
    workers: int = 2
    address: str | None = None
    progress: bool = True
    after_shard: Callable[[str, int], None] | None = None
    stages: dict[str, dict[str, Any]] = field(default_factory=dict)
    _owns_ray: bool = False

    def __enter__(self) -> ShardedEngine:
        try:
            import ray
        except ImportError as e:
            raise ImportError("the sharded engine needs Ray Data: pip install 'selection-callbacks[ray]' "
                              "(or run the single-process path: --engine local)") from e
        if self.workers < 1:
            raise SelectionError(f"--workers must be ≥ 1, got {self.workers}")
        if not ray.is_initialized():
            if self.address is None:
                ray.init(num_cpus=self.workers, include_dashboard=False, log_to_driver=False,
                         configure_logging=False)
            else:
                ray.init(address=self.address, log_to_driver=False, configure_logging=False)
            self._owns_ray = True
        ray.data.DataContext.get_current().enable_progress_bars = False
        self.work_dir = Path(self.work_dir)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._owns_ray:
            import ray

            ray.shutdown()
            self._owns_ray = False

    def run_stage(
        self, name: str, task: ShardTask, shards: PoolShards, kwargs: dict[str, Any], settings: dict[str, Any]
    ) -> list[Path]:
        """Every shard's table of stage ``name`` (computed where the manifest lacks it); their paths, shard order.

        ``settings`` (JSON) identify the stage's computation: the stage's folder is
        ``<work>/<name>-<sha256 of settings>``, so other settings never reuse these tables.
        """
        import ray

        text = json.dumps(settings, sort_keys=True)
        folder = self.work_dir / f"{name}-{hashlib.sha256(text.encode()).hexdigest()[:12]}"
        folder.mkdir(parents=True, exist_ok=True)
        manifest_path = folder / "manifest.json"
        manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else {
            "settings": json.loads(text), "shards": {}}
        paths = [folder / f"shard-{k:05d}.parquet" for k in range(len(shards))]
        todo = [k for k in range(len(shards)) if not (str(k) in manifest["shards"] and paths[k].exists())]
        start = time.perf_counter()
        bar = tqdm(total=len(shards), initial=len(shards) - len(todo), desc=f"sharded: {name}", unit="shard",
                   disable=not self.progress)
        if todo:
            rows = [{"shard": k, "source": str(shards.path(k)), "out": str(paths[k])} for k in todo]
            ds = ray.data.from_items(rows, override_num_blocks=len(rows)).map(
                _run_shard, fn_kwargs={"task": task, "kwargs": kwargs}, num_cpus=1,
                compute=ray.data.TaskPoolStrategy(size=self.workers))
            for record in ds.iter_rows():
                manifest["shards"][str(record["shard"])] = record
                write_json_atomic(manifest_path, manifest)
                bar.update(1)
                if self.after_shard is not None:
                    self.after_shard(name, int(record["shard"]))
        bar.close()
        self.stages[name] = _stage_costs(manifest["shards"], time.perf_counter() - start, len(todo))
        return paths

    def summary(self) -> dict[str, Any]:
        """Per stage: wall seconds in this run, shards computed and reused, and per worker its costs."""
        return dict(self.stages)


def _stage_costs(records: dict[str, dict[str, Any]], seconds: float, computed: int) -> dict[str, Any]:
    workers: dict[str, dict[str, float]] = {}
    for r in records.values():
        w = workers.setdefault(r["worker"], {"shards": 0, "rows": 0, "seconds": 0.0, "peak_rss_mb": 0.0})
        w["shards"] += 1
        w["rows"] += r["rows"]
        w["seconds"] = round(w["seconds"] + r["seconds"], 3)
        w["peak_rss_mb"] = max(w["peak_rss_mb"], r["peak_rss_mb"])
    return {"seconds": round(seconds, 2), "shards_computed": computed, "shards_reused": len(records) - computed,
            "workers": workers}
