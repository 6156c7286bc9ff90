"""Per-token and per-sample language-model losses, and the per-sample loss protocol every scoring method uses."""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F

from selection_callbacks.core.costs import CostMeter


@runtime_checkable
class PerSampleLoss(Protocol):
    def per_sample_loss(self, batch: MutableMapping) -> torch.Tensor:
        """Mean token loss of each sequence of the batch, [N]."""
        ...


def per_sample_loss(module: object, batch: MutableMapping) -> torch.Tensor:
    """``module.per_sample_loss(batch)``, or a clear error when the module lacks the protocol."""
    if not isinstance(module, PerSampleLoss):
        raise TypeError(
            f"{type(module).__name__} has no per_sample_loss(batch) -> Tensor[N]; add it to your LightningModule "
            "(mean token loss per sequence; docs/own-model-and-data.md shows one)"
        )
    return module.per_sample_loss(batch)


def learner_losses(module: object, batch: MutableMapping, meter: CostMeter) -> torch.Tensor:
    """[N] the learner's per-sample losses (:func:`per_sample_loss`), its forward counted in ``meter``."""
    meter.add("learner", "fwd", batch["input_ids"].numel())
    return per_sample_loss(module, batch)


def token_losses(logits: torch.Tensor, batch: MutableMapping) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token nats [N, T'], loss mask [N, T'] and targets [N, T'].

    With ``labels`` in the batch the logits predict them position by position; without, the
    model predicts ``input_ids`` shifted by one (``T' = T - 1``). ``loss_mask`` (0/1) is honoured.
    """
    if "labels" in batch:
        targets = batch["labels"]
    else:
        logits, targets = logits[:, :-1], batch["input_ids"][:, 1:]
    nll = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="none").view(targets.shape)
    mask = batch.get("loss_mask")
    mask = torch.ones_like(nll) if mask is None else mask[:, -targets.shape[1] :].to(nll.dtype)
    return nll, mask, targets


def sequence_means(nll: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """[N] mean of ``nll`` [N, T'] over each row's tokens with ``mask`` 1 (every token when ``mask`` is None)."""
    if mask is None:
        return nll.mean(1)
    return (nll * mask).sum(1) / mask.sum(1).clamp_min(1.0)


def mean_token_losses(model: torch.nn.Module):
    """``batch -> Tensor[N]``: mean next-token loss per row of a plain LM (ids → logits) on ``input_ids``/``labels``.

    Every position counts (``loss_mask`` is not read): the ghost engine's per-row loss.
    """

    def fn(batch: MutableMapping) -> torch.Tensor:
        logits = model(batch["input_ids"])
        nll = F.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten(), reduction="none")
        return sequence_means(nll.view(logits.shape[0], -1))

    return fn
