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
