"""RHO-LOSS: keep the candidates with the largest reducible holdout loss, ℓ_learner(z) − ℓ_ref(z).

The reference is a model trained on the target split (never val): a ``train.py`` checkpoint
scored on the fly (``reference``), losses precomputed once per pool sequence and looked up by
``sample_id`` (``reference_losses``, from ``selection-callbacks reference-losses``), or, with
neither, a proxy pretrained on the target split when training starts. The method card
(``README.md`` beside this file) has the commands that train and precompute one.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Literal

import lightning as L
import torch
from typing_extensions import override

from selection_callbacks.core.rng import micro_batch_generator
from selection_callbacks.offline.reference_losses import ReferenceLossTable
from selection_callbacks.scoring.windows import score_windows
from selection_callbacks.callbacks.protocols import needs_per_sample_loss
from selection_callbacks.methods.bases.proxy import ProxySelection


class RhoLossSelection(ProxySelection):
    """Score = ℓ(z; θ_learner) − ℓ(z; θ_ref) per candidate ([N] mean token losses); Mindermann et al. 2022.

    ℓ_ref comes from one of: ``reference_losses`` (a file precomputed by
    :mod:`selection_callbacks.offline.reference_losses`, looked up by ``sample_id``; checked
    against the pool and ``seq_len`` at setup), ``reference`` (a checkpoint, one frozen forward
    per step), or, when neither is given, a ``proxy_layers`` × ``proxy_width`` proxy of the
    learner's architecture (:meth:`ProxySelection.proxy_config`: a Hugging Face learner's own,
    else the plugin's GPT) pretrained at ``reference_lr`` for ``reference_steps`` steps on the
    target split before the first selection. The learner's forward and any reference forward are
    counted in ``select/cost/*``. With ``score_len`` = L both models score the same seeded random
    L-token window of each candidate instead of the whole sequence ([N, L] instead of [N, T]: L/T
    of the forwards).

    Example::

        trainer = L.Trainer(callbacks=[RhoLossSelection(ratio=0.5, reference="runs/rho_reference/reference.ckpt")])

    Args:
        ratio: kept fraction ρ = K/N.
        reference: a reference checkpoint (``train.py`` on the target split; command in the method card).
        reference_losses: a precomputed ``.npz`` of ℓ_ref per pool sequence: set it to score without a
            reference forward per step.
        reference_steps: without either: pretraining steps of a reference on the target split.
        reference_batch_size: target sequences per pretraining step.
        reference_lr: AdamW learning rate of that pretraining (constant).
        score_len: score a seeded random window of this many tokens per candidate (None: the whole
            sequence): set it to cut the scoring forwards when T is long. Not with ``reference_losses``,
            which hold whole-sequence losses.
        proxy_layers: layers of the pretrained reference.
        proxy_width: its width; vocabulary and context follow the learner.
        proxy_heads: its attention heads; set it when ``proxy_width`` is not a multiple of 4.
        sampling: ``"top_k"`` or ``"gumbel"``: set ``"gumbel"`` to draw K by score rather than take the top K.
        temperature: Gumbel-top-K temperature in nats.
        seed: selection seed; also draws the pretrained reference's initial weights and batches.
        k: keep exactly this many instead of ratio·N: set it to fix K whatever the superbatch size.
        nonfinite: see :class:`SelectionCallback`.

    Raises:
        ValueError: both or neither reference source (with ``reference_steps`` = 0), ``reference_lr`` ≤ 0,
            ``score_len`` < 1, or ``score_len`` with ``reference_losses``.
    """

    supported_stack = ProxySelection.FULL_STACK

    def __init__(
        self,
        ratio: float = 0.5,
        reference: str | None = None,
        reference_losses: str | None = None,
        reference_steps: int = 300,
        reference_batch_size: int = 16,
        reference_lr: float = 2e-3,
        score_len: int | None = None,
        proxy_layers: int = 2,
        proxy_width: int = 128,
        proxy_heads: int = 4,
        sampling: Literal["top_k", "gumbel"] = "top_k",
        temperature: float = 1.0,
        seed: int = 0,
        k: int | None = None,
        nonfinite: Literal["error", "lowest"] = "error",
    ) -> None:
        super().__init__(
            ratio=ratio, k=k, sampling=sampling, temperature=temperature, seed=seed, nonfinite=nonfinite,
            proxy_layers=proxy_layers, proxy_width=proxy_width, proxy_heads=proxy_heads, reference=reference,
            reference_steps=reference_steps, reference_batch_size=reference_batch_size,
        )
        if reference is not None and reference_losses is not None:
            raise ValueError("give RhoLossSelection reference (a checkpoint) or reference_losses (a file), not both")
        if reference is None and reference_losses is None and reference_steps == 0:
            raise ValueError(
                "RhoLossSelection needs a reference: reference=CKPT, reference_losses=FILE, or reference_steps > 0 to "
                "pretrain one on the target split (the README's RHO-LOSS section has the commands)"
            )
        if not reference_lr > 0:
            raise ValueError(f"reference_lr must be > 0, got {reference_lr}")
        if score_len is not None and score_len < 1:
            raise ValueError(f"score_len must be ≥ 1 or None (the whole sequence), got {score_len}")
        if score_len is not None and reference_losses is not None:
            raise ValueError(f"score_len={score_len}: windows need a reference that scores them (reference=CKPT or a "
                             "pretrained one), not reference_losses (whole-sequence losses)")
        self.score_len = score_len
        self.reference_losses, self.reference_lr = reference_losses, reference_lr
        self.table: ReferenceLossTable | None = None
        self._mean_losses: tuple[float, float] | None = None

    @override
    def requirements(self, trainer: L.Trainer, pl_module: L.LightningModule) -> list[str]:
        own = self.reference_losses is None and self.reference is None
        return needs_per_sample_loss(pl_module, type(self).__name__) + self.proxy_requirements(
            trainer, pl_module, builds=own, pretrains=own)

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if self.reference_losses is None or stage != "fit":
            return
        self.table = ReferenceLossTable(self.reference_losses)
        pool = getattr(getattr(trainer, "datamodule", None), "splits", {}).get("pool")
        if pool is None:
            raise ValueError("reference_losses are looked up in the PoolDataModule's pool: train with PoolDataModule")
        self.table.check_pool(pool)

    @override
    def create_proxies(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.reference_losses is None:
            self.add_reference(trainer, pl_module, self.reference_lr)

    @override
    def score(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: MutableMapping, batch_idx: int) -> torch.Tensor:
        if self.score_len is not None:  # both models see the same window of each candidate
            gen = micro_batch_generator(self.seed, trainer.current_epoch, batch_idx, "window")
            batch = score_windows(batch, self.score_len, gen, trainer.global_rank, trainer.world_size)
        learner = self.learner_losses(pl_module, batch).float()
        if self.table is not None:
            if not isinstance(batch.get("sample_id"), torch.Tensor):
                raise ValueError("reference_losses are looked up by sample_id: the superbatch carries none")
            reference = self.table.lookup(batch["sample_id"])
        elif "reference" in self.proxies:
            self.ensure_reference(trainer)
            reference = self.proxies["reference"].losses(batch).float()
        else:
            raise RuntimeError("RhoLossSelection builds its reference in on_train_start: add it to the Trainer")
        self._mean_losses = (float(learner.mean()), float(reference.mean()))
        return learner - reference

    @override
    def extra_metrics(self) -> dict[str, float]:
        out = super().extra_metrics()
        if self._mean_losses is not None:
            out["select/learner_loss"], out["select/reference_loss"] = self._mean_losses
        return out
