"""``SelectionDashboard``: throughput scalars for every logger, score histograms and domain tables for W&B."""

from __future__ import annotations

import time
from typing import Any

import lightning as L
from lightning.pytorch.loggers import WandbLogger
from typing_extensions import override

from selection_callbacks.callbacks.base import SelectionCallback, logs_this_step
from selection_callbacks.core.domains import domain_names
from selection_callbacks.core.selection import SelectionRecord


class SelectionDashboard(L.Callback):
    """What a selection run looks like while it trains.

    On the steps the Trainer writes logs (``log_every_n_steps``; through ``pl_module.log_dict``, so CSV,
    TensorBoard and W&B loggers all get them): ``throughput/candidate_tokens_per_sec`` (tokens the
    selector scored, all ranks) and ``throughput/update_tokens_per_sec`` (tokens trained on, all ranks),
    over the time since the previous micro-batch with validation excluded; the means in the run
    summary count every micro-batch.

    With a :class:`~lightning.pytorch.loggers.WandbLogger`, rank zero also logs, every
    ``histogram_every`` steps, ``selection/scores_chosen`` and ``selection/scores_rejected``
    (``wandb.Histogram`` of the global superbatch's scores) and ``selection/domains`` (a
    ``wandb.Table``: candidates and chosen per domain since the previous table); at the end of
    training it writes the selector's ``summary()`` (as ``selection/*``), the last ``select/*``
    values and the mean throughput into the run summary. Every rank holds the same gathered
    record, so no collective runs inside the rank-zero guard. The summary also holds the latest
    value of each diagnostic the selector logged on its diagnostic selections (``select/ess``, ...).

    Example::

        trainer = L.Trainer(callbacks=[HighLossSelection(0.5), SelectionDashboard(histogram_every=50)],
                            logger=WandbLogger(offline=True))

    Args:
        histogram_every: steps between W&B histograms and domain tables.
    """

    def __init__(self, histogram_every: int = 50) -> None:
        if histogram_every < 1:
            raise ValueError(f"histogram_every must be ≥ 1, got {histogram_every}")
        self.histogram_every = histogram_every
        self._selector: SelectionCallback | None = None
        self._wandb: list[WandbLogger] = []
        self._last_time: float | None = None
        self._paused_at: float | None = None
        self._last_histogram_step = -1
        self._domains: dict[str, list[int]] = {}  # name → [candidates, chosen] since the last table
        self._totals = {"seconds": 0.0, "candidate_tokens": 0, "update_tokens": 0}
        self._diagnostics: dict[str, float] = {}  # the latest value of each diagnostic scalar

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._selector = next((c for c in trainer.callbacks if isinstance(c, SelectionCallback)), None)
        self._wandb = [logger for logger in trainer.loggers if isinstance(logger, WandbLogger)]

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._last_time = time.perf_counter()

    @override
    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._paused_at = time.perf_counter()

    @override
    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._paused_at is not None and self._last_time is not None:
            self._last_time += time.perf_counter() - self._paused_at
        self._paused_at = None

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        now = time.perf_counter()
        record = self._selector.last_record if self._selector is not None else None
        tokens = batch["input_ids"].shape[-1] if isinstance(batch, dict) and "input_ids" in batch else 0
        updates = batch["input_ids"].shape[0] * trainer.world_size if tokens else 0
        candidates = record.scores.shape[0] if record is not None else updates
        if self._last_time is not None and tokens:
            seconds = max(now - self._last_time, 1e-9)
            self._totals["seconds"] += seconds
            self._totals["candidate_tokens"] += candidates * tokens
            self._totals["update_tokens"] += updates * tokens
            if logs_this_step(trainer):
                pl_module.log_dict(
                    {
                        "throughput/candidate_tokens_per_sec": candidates * tokens / seconds,
                        "throughput/update_tokens_per_sec": updates * tokens / seconds,
                    },
                    on_step=True,
                    on_epoch=False,
                    batch_size=batch["input_ids"].shape[0],
                )
        self._last_time = now
        if self._selector is not None:
            self._diagnostics.update(self._selector.last_diagnostics)
        if record is None or not self._wandb or not trainer.is_global_zero:
            return
        self._count_domains(trainer, record)
        if record.step % self.histogram_every == 0 and record.step != self._last_histogram_step:
            self._last_histogram_step = record.step
            media = self._media(record)
            for logger in self._wandb:
                logger.log_metrics(media, step=record.step)
            self._domains.clear()

    def _count_domains(self, trainer: L.Trainer, record: SelectionRecord) -> None:
        if record.domain is None:
            return
        names = getattr(getattr(trainer, "datamodule", None), "domain_names", None)
        chosen = record.selected_mask
        for name, kept in zip(domain_names(record.domain.tolist(), names), chosen.tolist()):
            counts = self._domains.setdefault(name, [0, 0])
            counts[0] += 1
            counts[1] += int(kept)

    def _media(self, record: SelectionRecord) -> dict[str, Any]:
        """W&B histograms of the chosen and rejected scores, and the domain table since the last one."""
        import wandb

        mask = record.selected_mask
        media: dict[str, Any] = {"selection/scores_chosen": wandb.Histogram(record.scores[mask].numpy())}
        if (~mask).any():
            media["selection/scores_rejected"] = wandb.Histogram(record.scores[~mask].numpy())
        if self._domains:
            chosen_total = max(sum(c for _, c in self._domains.values()), 1)
            rows = [[name, n, c, c / chosen_total, c / n] for name, (n, c) in sorted(self._domains.items())]
            media["selection/domains"] = wandb.Table(
                columns=["domain", "candidates", "chosen", "share_of_chosen", "kept_fraction"], data=rows
            )
        return media

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self._wandb or not trainer.is_global_zero:
            return
        summary = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("select/")}
        summary.update(self._diagnostics)
        if self._selector is not None:
            summary.update(_flatten(self._selector.summary(), "selection/"))
        seconds = self._totals["seconds"]
        if seconds > 0:
            summary["throughput/mean_candidate_tokens_per_sec"] = self._totals["candidate_tokens"] / seconds
            summary["throughput/mean_update_tokens_per_sec"] = self._totals["update_tokens"] / seconds
        for logger in self._wandb:
            logger.experiment.summary.update(summary)


def _flatten(values: dict[str, Any], prefix: str) -> dict[str, Any]:
    """``{"a": {"b": 1}}`` → ``{prefix + "a/b": 1}``; lists (a diagnostic's history, logged step by step) stay out."""
    out: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}/"))
        elif not isinstance(value, list):
            out[f"{prefix}{key}"] = value
    return out
