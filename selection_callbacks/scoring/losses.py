"""The per-sample loss protocol every scoring method uses."""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Protocol, runtime_checkable

import torch


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
            "(mean token loss per sequence, see models.lit_gpt.LitGPT.per_sample_loss)"
        )
    return module.per_sample_loss(batch)


def mean_token_losses(model: torch.nn.Module):
    """``batch -> Tensor[N]``: mean next-token loss per row of a plain LM (ids → logits) on ``input_ids``/``labels``."""
    import torch.nn.functional as F

    def fn(batch: MutableMapping) -> torch.Tensor:
        logits = model(batch["input_ids"])
        nll = F.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten(), reduction="none")
        return nll.view(logits.shape[0], -1).mean(1)

    return fn
