"""GREATS: greedy selection by a one-step Taylor estimate of the target-loss decrease, SGD geometry."""

from __future__ import annotations

from typing import Any

import lightning as L
from typing_extensions import override

from selection_callbacks.core.selection import Scores
from selection_callbacks.methods.bases.ghost import GhostSelection
from selection_callbacks.scoring.maps.base import StepMaps
from selection_callbacks.scoring.maps.step_maps import SGDStepMaps


class GreatsSelection(GhostSelection):
    """Greedy u_i = η⟨g_i, ḡ_target⟩ − η² Σ_{j∈S} ⟨g_i, g_j⟩ with η = lr/(W·K·A), per parameter group: one row's
    weight in the step, whose gradient is the mean over the K kept rows of each of the W DDP ranks (DDP
    averages the ranks' gradients) and A accumulated micro-batches, so row i moves the weights by −η·g_i.

    Plain gradients (no optimizer preconditioning), physical units (no calibration: greedy is
    scale-free and the interaction's weight relative to the utility is η itself).

    Example::

        trainer = L.Trainer(callbacks=[GreatsSelection(ratio=0.5)])

    Args:
        ratio: kept fraction ρ = K/N.
        **kwargs: :class:`GhostSelection` arguments (``score_len``, ``sketch_dim`` (0: no interaction
            term), ``target_batch_size``, ``target_file``, ``include_embedding``, ``include_head``, ``layers``,
            ``sketch``, ``candidate_chunk``, ``seed``, ``k``, ``nonfinite``); the draws are greedy.
    """

    def __init__(self, ratio: float = 0.5, **kwargs: Any) -> None:
        super().__init__(ratio=ratio, temperature=0.0, **kwargs)

    @override
    def step_maps(self, trainer: L.Trainer, k: int) -> StepMaps:
        # k is this rank's; the step averages over every rank's and micro-batch's kept rows
        return SGDStepMaps(trainer.optimizers[0], k * trainer.world_size * trainer.accumulate_grad_batches)

    @override
    def calibrate(self, scores: Scores, k: int) -> Scores:
        # with P = η·I the engine's utilities are η⟨g_i, ḡ⟩ and its sketches those of η g_i
        if scores.features is None:
            return scores
        S = scores.features.float()
        return Scores(scores.values.float(), S @ S.T)
