"""``RunRecorder``: validation curve against update tokens and training wall-clock, to metrics.json."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch._dynamo.utils import counters
from typing_extensions import override

from selection_callbacks.callbacks.base import SelectionCallback
from selection_callbacks.callbacks.stack import fit_stack
from selection_callbacks.core.io import write_json_atomic
from selection_callbacks.core.machine_load import LoadSnapshot, host_cpu, load_average, other_cpu_seconds


class RunRecorder(L.Callback):
    """Records ``[update_tokens, wall_seconds, val_bpb]`` at every validation and writes ``metrics.json``.

    (``val_loss`` takes bpb's place when the data's token byte lengths are unknown: ``curve_metric``.)

    With a :class:`SelectionCallback` present it also records, at each validation, the cumulative domain
    counts of the kept candidates (``domain_history``) and the selection's cumulative seconds
    (``selection_curve``, ``[update_tokens, seconds]``: the part of the wall-clock its hooks took, so a
    step's training and selection parts are measured in the same run, at the same moments).

    Update tokens count the label tokens the optimizer trained on (after selection), summed
    over ranks; wall-clock is training time with validation excluded. The file is rewritten
    after each validation (rank zero), so an interrupted run keeps its curve.

    With a compiled learner it also records Dynamo's graph count at each validation (``dynamo_graphs``,
    ``[update_tokens, graphs]``, this process's compilations so far): a count that stops growing after the
    first steps and validation means the steps run without recompiling.

    ``machine`` says how busy the machine was while the run trained (rank zero's view,
    :mod:`selection_callbacks.core.machine_load`): ``other_cpus``, the mean number of CPUs other
    processes held, and the 1-minute load average at each validation, so a report can tell runs
    trained alone from runs trained beside other jobs (other ranks on the same machine count as
    other work); ``cpu`` names the processor the run timed on.

    Example::

        trainer = L.Trainer(callbacks=[RandomSelection(0.5), RunRecorder("runs/demo")])

    Args:
        out_dir: folder for ``metrics.json`` (default: the trainer's ``default_root_dir``).
        progress_every: print a progress line on rank zero at most every this many seconds
            (step, update tokens, tokens/s of training time, the selection's share of it, the last
            validation); None: silent.
    """

    def __init__(self, out_dir: str | None = None, progress_every: float | None = None) -> None:
        if progress_every is not None and progress_every <= 0:
            raise ValueError(f"progress_every must be > 0 seconds (or None), got {progress_every}")
        self.out_dir = out_dir
        self.progress_every = progress_every
        self._last_print: float | None = None
        self.update_tokens = 0
        self.curve: list[list[float]] = []
        self.domain_history: list[list[Any]] = []
        self.selection_curve: list[list[float]] = []
        self.summary: dict[str, Any] = {}
        self._train_seconds = 0.0
        self._resumed_at: float | None = None
        self._load_start: LoadSnapshot | None = None
        self._other_cpu_seconds = 0.0  # of earlier segments (before a resume)
        self._load_wall_seconds = 0.0
        self.load_history: list[list[float | None]] = []
        self.dynamo_graphs: list[list[int]] | None = None  # a compiled learner's only

    def wall_seconds(self) -> float:
        """Training seconds so far, validation excluded."""
        running = time.perf_counter() - self._resumed_at if self._resumed_at is not None else 0.0
        return self._train_seconds + running

    def _load_totals(self) -> tuple[float | None, float]:
        """Other processes' CPU-seconds (None without ``/proc/stat``) and the wall seconds they span, so far."""
        other: float | None = self._other_cpu_seconds
        wall = self._load_wall_seconds
        if self._load_start is not None:
            now = LoadSnapshot.now()
            segment = other_cpu_seconds(self._load_start, now)
            other = None if segment is None else other + segment
            wall += now.wall - self._load_start.wall
        return other, wall

    def machine_load(self) -> dict[str, Any]:
        """``{"cpu", "cpus", "torch_threads", "other_cpus", "load_average"}`` of the run so far (cpu: the processor,
        :func:`~selection_callbacks.core.machine_load.host_cpu`; other_cpus: None where the platform has no
        ``/proc/stat``)."""
        other, wall = self._load_totals()
        return {
            "cpu": host_cpu(),
            "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "other_cpus": None if other is None or wall <= 0 else round(other / wall, 3),
            "load_average": self.load_history,
        }

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._resumed_at = time.perf_counter()
        self._load_start = LoadSnapshot.now()
        if fit_stack(pl_module).compiled and self.dynamo_graphs is None:
            self.dynamo_graphs = []

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        labels = batch.get("labels", batch.get("input_ids")) if isinstance(batch, dict) else None
        if labels is not None:
            self.update_tokens += int(labels.numel()) * trainer.world_size
        if self.progress_every is not None and trainer.is_global_zero:
            now = time.perf_counter()
            if self._last_print is None:
                self._last_print = now
            elif now - self._last_print >= self.progress_every:
                self._last_print = now
                print(self.progress_line(trainer), flush=True)

    def progress_line(self, trainer: L.Trainer) -> str:
        """``[train] step s/S · tokens · tok/s · selection share · last val``."""
        wall = self.wall_seconds()
        selector = next((c for c in trainer.callbacks if isinstance(c, SelectionCallback)), None)
        share = f" · selection {selector.overhead_seconds / wall:.0%} of it" if selector is not None and wall > 0 else ""
        last = f" · val {self.curve[-1][2]:.4f} at {self.curve[-1][0]:,} tokens" if self.curve else ""
        total = f"/{trainer.max_steps}" if trainer.max_steps and trainer.max_steps > 0 else ""
        rate = self.update_tokens / wall if wall > 0 else 0.0
        return (f"[train] step {trainer.global_step}{total} · {self.update_tokens:,} update tokens in {wall:.0f} s "
                f"({rate:,.0f} tok/s){share}{last}")

    @override
    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._train_seconds = self.wall_seconds()
        self._resumed_at = None

    @override
    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.state.fn == "fit":
            self._resumed_at = time.perf_counter()
        if trainer.sanity_checking:
            return
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/")}
        metric = "val/bpb" if "val/bpb" in metrics else "val/loss"  # loss when bytes are unknown (.bin data)
        if metric in metrics and (not self.curve or self.curve[-1][0] != self.update_tokens):
            self.curve.append([self.update_tokens, round(self._train_seconds, 3), metrics[metric]])
        if not self.load_history or self.load_history[-1][0] != self.update_tokens:
            self.load_history.append([self.update_tokens, load_average()])
        if self.dynamo_graphs is not None and (not self.dynamo_graphs or self.dynamo_graphs[-1][0] != self.update_tokens):
            self.dynamo_graphs.append([self.update_tokens, int(counters["stats"]["unique_graphs"])])
        selector = next((c for c in trainer.callbacks if isinstance(c, SelectionCallback)), None)
        if selector is not None and (not self.domain_history or self.domain_history[-1][0] != self.update_tokens):
            self.domain_history.append([self.update_tokens, dict(selector.domain_counts)])
            self.selection_curve.append([self.update_tokens, round(selector.overhead_seconds, 4)])
        self.summary = {
            "val_bpb": metrics.get("val/bpb"),
            "val_loss": metrics.get("val/loss"),
            "global_step": trainer.global_step,
            "update_tokens": self.update_tokens,
            "wall_seconds": round(self._train_seconds, 3),
            "curve": self.curve,
            "curve_metric": metric.replace("/", "_"),
            "domain_history": self.domain_history,
            "selection_curve": self.selection_curve,
            "selection": selector.summary() if selector is not None else None,
            "machine": self.machine_load(),
        } | ({"dynamo_graphs": self.dynamo_graphs} if self.dynamo_graphs is not None else {})
        if trainer.is_global_zero:
            self.write(Path(self.out_dir or trainer.default_root_dir) / "metrics.json")

    def write(self, path: Path) -> None:
        """Atomically write the summary as JSON."""
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, self.summary)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "update_tokens": self.update_tokens,
            "curve": self.curve,
            "domain_history": self.domain_history,
            "selection_curve": self.selection_curve,
            "train_seconds": self.wall_seconds(),
            "load": dict(zip(("other_cpu_seconds", "wall_seconds"), self._load_totals()), history=self.load_history),
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.update_tokens = int(state_dict["update_tokens"])
        self.curve = [list(p) for p in state_dict["curve"]]
        self.domain_history = [list(p) for p in state_dict["domain_history"]]
        self.selection_curve = [list(p) for p in state_dict.get("selection_curve", [])]  # absent in older checkpoints
        self._train_seconds = float(state_dict["train_seconds"])
        load = state_dict.get("load", {})  # a checkpoint without it: no load recorded
        self._other_cpu_seconds = float(load.get("other_cpu_seconds") or 0.0)
        self._load_wall_seconds = float(load.get("wall_seconds", 0.0))
        self.load_history = [list(p) for p in load.get("history", [])]
