"""GREATS: greedy selection by a one-step Taylor estimate of the proxy-loss decrease, SGD geometry."""

from __future__ import annotations

import lightning as L
from typing_extensions import override

from selection_callbacks.callbacks.base import Scores
from selection_callbacks.scoring.ghost import Resolver
from selection_callbacks.callbacks.ghost import GhostSelection
from selection_callbacks.scoring.preconditioners import SGDStepPreconditioner


class GreatsSelection(GhostSelection):
    """Greedy u_i = η⟨g_i, ḡ_proxy⟩ − η² Σ_{j∈S} ⟨g_i, g_j⟩ with η = lr/K (the step of the batch mean;
    per parameter group, and over K × accumulation steps when gradients accumulate).

    Plain gradients (no optimizer preconditioning), physical units (no calibration: greedy is
    scale-free and the interaction's weight relative to the utility is η itself).

    Example::

        trainer = L.Trainer(callbacks=[GreatsSelection(ratio=0.5)])

    Args:
        ratio: kept fraction ρ = K/N.
        score_len: tokens scored per candidate.
        sketch_dim: m of the interaction sketches (0: no interaction term).
        proxy_batch_size: proxy sequences per micro-batch.
        proxy: a proxy file; default: the datamodule's target split.
        include_embedding: also score the token embedding.
        include_head: also score the output head.
        layers: glob patterns of the module names to score (None: all of the above).
        sketch: ``"tensor"``, ``"count"`` or ``"two_sided"``.
        candidate_chunk: candidates per scoring pass (flat memory in N; None: one pass).
        seed: selection seed.
        k: keep exactly this many instead of ratio·N.
    """

    def __init__(
        self,
        ratio: float = 0.5,
        score_len: int = 64,
        sketch_dim: int = 1024,
        proxy_batch_size: int = 8,
        proxy: str | None = None,
        include_embedding: bool = False,
        include_head: bool = False,
        layers: list[str] | None = None,
        sketch: str = "tensor",
        candidate_chunk: int | None = None,
        seed: int = 0,
        k: int | None = None,
    ) -> None:
        super().__init__(
            ratio, score_len, sketch_dim, proxy_batch_size, proxy, include_embedding, include_head, layers, sketch,
            candidate_chunk, temperature=0.0, seed=seed, k=k,
        )

    @override
    def preconditioner(self, trainer: L.Trainer, k: int) -> Resolver:
        return SGDStepPreconditioner(trainer.optimizers[0], k * trainer.accumulate_grad_batches)

    @override
    def calibrate(self, scores: Scores, k: int) -> Scores:
        # with P = η·I the engine's utilities are η⟨g_i, ḡ⟩ and its sketches those of η g_i
        if scores.features is None:
            return scores
        S = scores.features.float()
        return Scores(scores.values.float(), S @ S.T)
