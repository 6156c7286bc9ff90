"""Random selection: K of N uniformly, the baseline every method is measured against."""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

import lightning as L
import torch
from typing_extensions import override

from selection_callbacks.callbacks.base import SelectionCallback


class RandomSelection(SelectionCallback):
    """Keep K = ratio·N candidates uniformly at random (no scoring cost).

    Example::

        trainer = L.Trainer(callbacks=[RandomSelection(ratio=0.5, seed=0)])

    Args:
        ratio: kept fraction ρ = K/N.
        seed: selection seed.
        k: keep exactly this many instead of ratio·N: set it to fix K whatever the superbatch size.
        **fit_options: the base's fit options (``per_sample_keys``, ``whole_batch_keys``, ``strict_resume``,
            ``short_superbatch``; :class:`~selection_callbacks.callbacks.base.SelectionCallback`).
    """

    supported_stack = SelectionCallback.FULL_STACK

    def __init__(self, ratio: float = 0.5, seed: int = 0, k: int | None = None, **fit_options: Any) -> None:
        super().__init__(ratio=ratio, k=k, sampling="uniform", seed=seed, **fit_options)

    @override
    def score(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: MutableMapping, batch_idx: int) -> torch.Tensor:
        return torch.zeros(batch["input_ids"].shape[0])
