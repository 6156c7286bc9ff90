"""OPUS: optimizer-induced projected utility selection."""

from __future__ import annotations

from functools import partial
from typing import Any, Literal

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from selection_callbacks.core.selection import Scores
from selection_callbacks.scoring.ghost import Resolver
from selection_callbacks.methods.bases.ghost import GhostSelection
from selection_callbacks.scoring.preconditioners import AdamWMap, HeldPoints, OptimizerPreconditioner, check_map_options


class OPUSSelection(GhostSelection):
    """Select by alignment of each candidate's optimizer-induced update with a proxy direction.

    Utility u_i = Σ_l ⟨G_i, −J_lᵀ ḡ_proxy⟩, the first-order decrease of the proxy loss through the
    live optimizer's next step, J_l its derivative in the fresh gradient (AdamW at frozen moments,
    Muon through the exact vector–Jacobian product of its Newton–Schulz iteration, or both,
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

        trainer = L.Trainer(callbacks=[OPUSSelection(ratio=0.5, score_len=64, temperature=0.25)])

    Args:
        ratio: kept fraction ρ = K/N.
        temperature: τ in standard deviations of utility (0: greedy).
        redundancy_weight: γ (0: no interaction term, and no sketches are built since nothing reads them).
            ``sketch_dim=0`` also turns the term off: there are no sketches to build it from.
        adamw_map: AdamW's second moment in the map: ``"frozen"`` (torch's v, the derivative at g → 0)
            or ``"proxy_in_v"`` (the proxy gradient's share put into v at every step).
        muon_point: where Muon's Newton–Schulz derivative is evaluated: ``"momentum"`` (the momentum
            torch's step will orthogonalise, the fresh gradient's share → 0: one vector–Jacobian product
            per matrix), ``"batch"`` (the momentum plus the share of a batch of K × accumulation rows
            drawn from the candidates, averaged over ``muon_draws`` points; before the first step the
            drawn batches alone set the point) or ``"moments"`` (one point carrying such a batch's
            expected first and second moments, estimated from the candidates: the share of their mean
            gradient that stands above its noise in the momentum, the rest of the batch's second moment in
            Newton–Schulz's Gram matrix; one vector–Jacobian product per matrix, plus the candidates' mean
            gradient and covariance). Against the real step's marginal effects on a tiny GPT, median
            Spearman over 24 seeds (0–23, 2 threads) at steps 5 / 50 / 300 (bench/results/ghost/README.md):
            momentum 0.912 / 0.755 / 0.893, moments 0.928 / 0.856 / 0.918, batch with 8 independent draws
            0.928 / 0.881 / 0.926, with one mirrored pair 0.929 / 0.894 / 0.928. On cpu-tiny's step, in-run,
            the momentum point costs 1.57× random's, moments 1.70×, the mirrored pair about 2.0×.
            The batch point draws from the candidates this rank scores in one pass, and the moments point
            reads the candidates of one pass (the first chunk under ``candidate_chunk``) summed over the DDP
            ranks, so the batch point's selections depend on the world size, and both on the chunking; the
            momentum point's depend on neither.
        muon_draws: evaluation points for ``muon_point="batch"`` (one vector–Jacobian product each per matrix).
        muon_mirrored: the points as ``muon_draws``/2 drawn batches ḡ_S and their mirror images 2ḡ_C − ḡ_S
            about the candidates' mean ḡ_C (antithetic pairs: the derivative's terms odd in the batch's
            noise cancel), or ``muon_draws`` independent draws.
        muon_refresh: optimizer steps each Muon momentum point is held (``muon_point="momentum"``; see
            :class:`~selection_callbacks.scoring.preconditioners.HeldPoints`): the eigendecompositions run on
            one step in ``muon_refresh`` and give that step's frozen map to the sketches until the next, and the
            vector–Jacobian products run on every step's proxy gradient at a point up to ``muon_refresh`` − 1
            steps old. 1: every step's own momentum. On cpu-tiny under tuned
            Muon, 4 saves 0.11 of a random step (1.44× against 1.55×; 1.40× without the sketch) and keeps 69% of
            the online oracle's gain against 79% (71% without the sketch; 3 paired seeds,
            bench/results/default-muon-refresh/README.md).
        **kwargs: :class:`GhostSelection` arguments (``score_len``, ``sketch_dim``,
            ``proxy_batch_size``, ``proxy``, ``include_embedding``, ``seed``, ...).
    """

    def __init__(
        self,
        ratio: float = 0.5,
        temperature: float = 0.25,
        redundancy_weight: float = 1.0,
        adamw_map: AdamWMap = "frozen",
        muon_point: Literal["batch", "momentum", "moments"] = "momentum",
        muon_draws: int = 8,
        muon_mirrored: bool = False,
        muon_refresh: int = 1,
        **kwargs: Any,
    ) -> None:
        if muon_point not in ("batch", "momentum", "moments"):
            raise ValueError(f"muon_point must be 'batch', 'momentum' or 'moments', got {muon_point!r}")
        self.held = HeldPoints(muon_refresh, {}) if muon_refresh != 1 else None
        if self.held is not None and muon_point != "momentum":
            raise ValueError(f"muon_refresh={muon_refresh} holds momentum points; muon_point={muon_point!r} draws a new point "
                             "from each step's candidates: use muon_point='momentum' or muon_refresh=1")
        check_map_options(adamw_map, muon_draws, muon_mirrored)
        if redundancy_weight < 0:
            raise ValueError(f"redundancy_weight must be ≥ 0, got {redundancy_weight}")
        if redundancy_weight == 0:  # nothing would read the sketches
            kwargs["sketch_dim"] = 0
        super().__init__(ratio=ratio, temperature=temperature, **kwargs)
        self.redundancy_weight, self.adamw_map = redundancy_weight, adamw_map
        self.muon_point, self.muon_draws, self.muon_mirrored = muon_point, muon_draws, muon_mirrored

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if self.held is not None:
            self.held.names = {id(p): name for name, p in pl_module.named_parameters()}

    @override
    def preconditioner(self, trainer: L.Trainer, k: int) -> Resolver:
        batch = k * trainer.accumulate_grad_batches if self.muon_point != "momentum" else None
        reduce = None
        if self.muon_point == "moments" and trainer.world_size > 1:  # every rank's candidates, the global batch
            batch *= trainer.world_size
            reduce = partial(trainer.strategy.reduce, reduce_op="sum")
        if self.held is not None:
            self.held.step = trainer.global_step
        return OptimizerPreconditioner(trainer.optimizers[0], self.adamw_map, batch, self.muon_draws, self.muon_mirrored,
                                       muon_moments=self.muon_point == "moments", muon_reduce=reduce, muon_held=self.held)

    @override
    def requirements(self, trainer: L.Trainer, pl_module: L.LightningModule) -> list[str]:
        problems = super().requirements(trainer, pl_module)
        try:
            if trainer.optimizers:
                OptimizerPreconditioner(trainer.optimizers[0])
        except TypeError as e:
            problems.append(f"{e}: OPUS preconditions by the optimizer's own step")
        return problems

    @override
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_fit_start(trainer, pl_module)
        if (self.muon_point == "batch" and trainer.world_size > 1) or (self.muon_point != "momentum" and self.candidate_chunk):
            where = "one rank's first pass" if self.muon_point == "batch" else "the first pass"
            rank_zero_warn(
                f"OPUSSelection(muon_point={self.muon_point!r}) reads Muon's evaluation point from the candidates of {where} "
                f"(world size {trainer.world_size}, candidate_chunk={self.candidate_chunk}), so its selections "
                "differ from a single-process, unchunked run; muon_point='momentum' does not depend on either"
            )

    @override
    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), **({"muon_points": self.held.state_dict()} if self.held is not None else {})}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        if self.held is not None:
            self.held.load_state_dict(state_dict.get("muon_points", {}))

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
