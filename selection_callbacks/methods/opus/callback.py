"""OPUS: optimizer-induced projected utility selection."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from typing_extensions import override

from selection_callbacks.core.selection import Scores
from selection_callbacks.methods.bases.ghost import GhostSelection
from selection_callbacks.scoring.maps.base import StepMaps
from selection_callbacks.scoring.maps.step_maps import OptimizerStepMaps


class OPUSSelection(GhostSelection):
    """Select by alignment of each candidate's optimizer-induced update with a target direction.

    Utility u_i = Σ_l ⟨G_i, −J_lᵀ ḡ_target⟩, the first-order decrease of the target loss through the
    live optimizer's next step, J_l its derivative in the fresh gradient (AdamW at frozen moments,
    Muon through the exact vector–Jacobian product of its Newton–Schulz iteration at the momentum, or both,
    auto-detected; SGD gives GREATS' geometry), and redundancy I_ij ∝ ⟨P G_i, P G_j⟩/K from
    sketches of the frozen maps P. Calibration makes τ and γ scale-free: utilities are
    standardised within the superbatch (û = (u − ū)/σ_u) and the interaction is the sketch
    inner product over the mean squared sketch norm, so
    I_ij = γ·⟨S_i, S_j⟩ / (K · mean_i ‖S_i‖²): a candidate as similar (at norm level) to every
    member of a full selected set loses γ standard deviations of utility. Selection draws K
    times i ∝ exp(g_i/τ) and then g_j ← g_j − I_ij (τ = 0: greedy).

    Logs the raw utility scale on the Trainer's logging steps and, on diagnostic selections (``diagnostics_every``),
    ``select/ess``, ``select/redundancy_changed`` (the share of the choice the penalty changed,
    against the same draws without it) and :class:`GhostSelection`'s trust diagnostics.

    Example::

        trainer = L.Trainer(callbacks=[OPUSSelection(ratio=0.5)])

    Args:
        ratio: kept fraction ρ = K/N.
        temperature: τ in standard deviations of utility (0: greedy).
        redundancy_weight: γ (0: no interaction term, and no sketches are built since nothing reads them).
            ``sketch_dim=0`` also turns the term off: there are no sketches to build it from.
        **kwargs: :class:`GhostSelection` arguments (``score_len``, ``sketch_dim``,
            ``target_batch_size``, ``target_file``, ``include_embedding``, ``seed``, ...).
    """

    def __init__(self, ratio: float = 0.5, temperature: float = 0.25, redundancy_weight: float = 1.0, **kwargs: Any) -> None:
        if redundancy_weight < 0:
            raise ValueError(f"redundancy_weight must be ≥ 0, got {redundancy_weight}")
        if redundancy_weight == 0:  # nothing would read the sketches
            kwargs["sketch_dim"] = 0
        super().__init__(ratio=ratio, temperature=temperature, **kwargs)
        self.redundancy_weight = redundancy_weight

    @override
    def step_maps(self, trainer: L.Trainer, k: int) -> StepMaps:
        return OptimizerStepMaps(trainer.optimizers[0])

    @override
    def requirements(self, trainer: L.Trainer, pl_module: L.LightningModule) -> list[str]:
        problems = super().requirements(trainer, pl_module)
        try:
            if trainer.optimizers:
                OptimizerStepMaps(trainer.optimizers[0])
        except TypeError as e:
            problems.append(f"{e}: OPUS maps gradients by the optimizer's own step")
        return problems

    @override
    def calibrate(self, scores: Scores, k: int) -> Scores:
        u = scores.values.float()
        scale = u.std() if u.numel() > 1 else torch.tensor(0.0)
        values = (u - u.mean()) / scale if scale > 0 else torch.zeros_like(u)
        if self.redundancy_weight == 0 or scores.features is None:
            return Scores(values)
        S = scores.features.float()
        gram = S @ S.T
        norm = gram.diagonal().mean().clamp_min(torch.finfo(torch.float32).tiny)
        return Scores(values, self.redundancy_weight * gram / (k * norm))
