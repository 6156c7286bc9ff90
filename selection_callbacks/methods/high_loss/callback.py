"""High-loss selection: the K candidates the learner currently predicts worst."""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

import lightning as L
import torch
from typing_extensions import override

from selection_callbacks.callbacks.base import SelectionCallback
from selection_callbacks.callbacks.protocols import needs_per_sample_loss
from selection_callbacks.scoring.losses import learner_losses


class HighLossSelection(SelectionCallback):
    """Score = the learner's mean token loss ℓ(z; θ) on each candidate (one forward, no grad).

    The "PPL" baseline of OPUS; with ``sampling="gumbel"`` it samples by loss instead of top-K.

    Example::

        trainer = L.Trainer(callbacks=[HighLossSelection(ratio=0.5)])

    Args:
        ratio: kept fraction ρ = K/N.
        **kwargs: the remaining :class:`SelectionCallback` arguments.
    """

    supported_stack = SelectionCallback.FULL_STACK

    def __init__(self, ratio: float = 0.5, **kwargs: Any) -> None:
        super().__init__(ratio=ratio, **kwargs)

    @override
    def requirements(self, trainer: L.Trainer, pl_module: L.LightningModule) -> list[str]:
        return needs_per_sample_loss(pl_module, type(self).__name__)

    @override
    def score(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: MutableMapping, batch_idx: int) -> torch.Tensor:
        return learner_losses(pl_module, batch, self.meter)
