"""RHO-LOSS: keep the candidates with the largest reducible holdout loss, ℓ_learner(z) − ℓ_ref(z).

The reference is a model trained on the target split (never val): a trained model given as an
``nn.Module``, a Hugging Face model folder or a ``train.py`` checkpoint and scored on the fly
(``reference``), losses precomputed once per row and looked up by ``sample_id`` (``reference_losses``,
from ``selection-callbacks reference-losses`` or :meth:`ReferenceLossTable.of_batches`), or, with
neither, a proxy pretrained on the target split when training starts. The method card (``README.md``
beside this file) has the commands that train and precompute one.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any, Literal

import lightning as L
import torch
import torch.nn as nn
from typing_extensions import override

from selection_callbacks.callbacks.protocols import needs_per_sample_loss
from selection_callbacks.methods.bases.proxy import ProxySelection
from selection_callbacks.scoring.losses import learner_losses, per_sample_loss
from selection_callbacks.scoring.reference_losses import ReferenceLossTable
from selection_callbacks.scoring.windows import candidate_windows, ignored_mask_problem, ignores_loss_mask


class RhoLossSelection(ProxySelection):
    """Score = ℓ(z; θ_learner) − ℓ(z; θ_ref) per candidate ([N] mean token losses); Mindermann et al. 2022.

    ℓ_ref comes from one of:

    - ``reference``: a trained reference, one frozen forward per step: an ``nn.Module`` with the
      learner's vocabulary (``per_sample_loss(batch) -> [N]``, or ``forward(input_ids)`` → logits
      [N, T, V]; its vocabulary declared as ``vocab_size`` or ``config.vocab_size``), a Hugging Face
      ``save_pretrained`` folder (safetensors), or a ``LitGPT``/``LitCausalLM`` checkpoint (read as
      data). A copy scores; the given reference is never trained (``reference_steps`` is unused).
    - ``reference_losses``: a precomputed ``.npz`` (:class:`ReferenceLossTable`) looked up by
      ``sample_id``, from any DataModule: each row's checksum must match the table's (at every
      lookup), and with a ``PoolDataModule`` the packed pool's fingerprint too (at setup).
    - neither: ``build_proxy(..., "reference")``, by default a ``proxy_layers`` × ``proxy_width``
      proxy of the learner's architecture (:meth:`ProxySelection.proxy_config`: a Hugging Face
      learner's own, else the plugin's GPT), trained at ``reference_lr`` for ``reference_steps`` steps
      on the target split before the first selection; with ``reference_steps=0`` an overridden
      ``build_proxy`` returns the trained reference, scored as it is.

    The reference's vocabulary must equal the learner's (checked before the first step, naming both
    sizes). The learner's forward and any reference forward are counted in ``select/cost/*``. With
    ``score_len`` = L both models score the same seeded random L-token window of each candidate instead
    of the whole sequence ([N, L] instead of [N, T]: L/T of the forwards); with ``window_context`` each window
    is scored after its own prefix (the rows stay [N, T], the loss counted on the window only).

    Example::

        trainer = L.Trainer(callbacks=[RhoLossSelection(ratio=0.5, reference="runs/rho_reference/reference.ckpt")])
        trainer = L.Trainer(callbacks=[RhoLossSelection(ratio=0.5, reference=AutoModelForCausalLM.from_pretrained(
            "runs/my_reference", local_files_only=True))])

    Args:
        ratio: kept fraction ρ = K/N.
        reference: a trained reference: an ``nn.Module``, a Hugging Face model folder or a checkpoint
            (the command that trains one is in the method card).
        reference_losses: a precomputed ``.npz`` of ℓ_ref per row: set it to score without a reference
            forward per step.
        reference_steps: without either: steps of the reference built here on the target split.
        reference_batch_size: target sequences per such step.
        reference_lr: AdamW learning rate of those steps (constant).
        score_len: score a seeded random window of this many tokens per candidate (None: the whole
            sequence): set it to cut the scoring forwards when T is long. Not with ``reference_losses``,
            which hold whole-sequence losses.
        window_context: with ``score_len``, score each window after its prefix in the sequence (the same
            window's tokens, loss counted there only): set it when windows cut out of long sequences lose the
            meaning their context gives them; the forwards then run over all T tokens. The learner's and a
            given reference's ``per_sample_loss`` must honour ``loss_mask`` (checked before the first step).
        proxy_layers: layers of the built reference.
        proxy_width: its width; vocabulary and context follow the learner.
        proxy_heads: its attention heads; set it when ``proxy_width`` is not a multiple of 4.
        sampling: ``"top_k"`` or ``"gumbel"``: set ``"gumbel"`` to draw K by score rather than take the top K.
        temperature: Gumbel-top-K temperature in nats.
        seed: selection seed; also draws the built reference's initial weights and batches.
        k: keep exactly this many instead of ratio·N: set it to fix K whatever the superbatch size.
        nonfinite: see :class:`SelectionCallback`.
        **fit_options: the base's fit options (``per_sample_keys``, ``whole_batch_keys``, ``strict_resume``,
            ``short_superbatch``; :class:`~selection_callbacks.callbacks.base.SelectionCallback`).

    Raises:
        ValueError: both reference sources; neither with ``reference_steps`` = 0 and the default
            ``build_proxy``; ``reference_lr`` ≤ 0, ``score_len`` < 1, ``score_len`` with ``reference_losses``, or
            ``window_context`` without ``score_len``.
    """

    supported_stack = ProxySelection.FULL_STACK

    def __init__(
        self,
        ratio: float = 0.5,
        reference: str | nn.Module | None = None,
        reference_losses: str | None = None,
        reference_steps: int = 300,
        reference_batch_size: int = 16,
        reference_lr: float = 2e-3,
        score_len: int | None = None,
        window_context: bool = False,
        proxy_layers: int = 2,
        proxy_width: int = 128,
        proxy_heads: int = 4,
        sampling: Literal["top_k", "gumbel"] = "top_k",
        temperature: float = 1.0,
        seed: int = 0,
        k: int | None = None,
        nonfinite: Literal["error", "lowest"] = "error",
        **fit_options: Any,
    ) -> None:
        if reference is not None and reference_losses is not None:
            raise ValueError("give RhoLossSelection reference (a trained model) or reference_losses (a file), not both")
        if reference is None and reference_losses is None and reference_steps == 0 and not self.builds_own_proxies:
            raise ValueError(
                "RhoLossSelection needs a reference: reference= a trained nn.Module, a Hugging Face model folder or a "
                "train.py checkpoint; reference_losses=FILE; reference_steps > 0 to pretrain one on the target split; "
                "or reference_steps=0 with build_proxy() overridden to return a trained one (the RHO-LOSS method "
                "card has the commands)"
            )
        if not reference_lr > 0:
            raise ValueError(f"reference_lr must be > 0, got {reference_lr}")
        if score_len is not None and score_len < 1:
            raise ValueError(f"score_len must be ≥ 1 or None (the whole sequence), got {score_len}")
        if score_len is not None and reference_losses is not None:
            raise ValueError(f"score_len={score_len}: windows need a reference that scores them (reference= a trained "
                             "model or a pretrained one), not reference_losses (whole-sequence losses)")
        if window_context and score_len is None:
            raise ValueError("window_context=True scores windows after their prefix: give score_len (the window's "
                             "tokens), or drop window_context to score whole sequences")
        super().__init__(
            ratio=ratio, k=k, sampling=sampling, temperature=temperature, seed=seed, nonfinite=nonfinite,
            proxy_layers=proxy_layers, proxy_width=proxy_width, proxy_heads=proxy_heads, reference=reference,
            reference_steps=reference_steps, reference_batch_size=reference_batch_size, reference_lr=reference_lr,
            uses_reference=reference_losses is None, **fit_options,
        )
        self.score_len, self.window_context = score_len, window_context
        self._mask_checked = False  # whether the losses were checked to honour loss_mask (window_context)
        self.reference_losses = reference_losses
        self.table: ReferenceLossTable | None = None
        self._mean_losses: tuple[float, float] | None = None

    @override
    def requirements(self, trainer: L.Trainer, pl_module: L.LightningModule) -> list[str]:
        return needs_per_sample_loss(pl_module, type(self).__name__) + self.proxy_requirements(
            trainer, pl_module, builds=False)

    @override
    def row_requirements(self, trainer: L.Trainer, pl_module: L.LightningModule) -> list[str]:
        if not self.window_context or self._target_rows is None:
            return []
        self._mask_checked = True
        rows = {k: v.to(pl_module.device) for k, v in self._target_rows.items() if isinstance(v, torch.Tensor)}
        with trainer.precision_plugin.train_step_context():
            return self._mask_problems(pl_module, rows)

    def _mask_problems(self, pl_module: L.LightningModule, rows: MutableMapping) -> list[str]:
        """Which of the learner and a given reference score ``rows`` alike whatever their ``loss_mask``."""
        scorers = {"the learner's": pl_module}
        if self.reference is not None and self.reference.given:
            scorers["the reference's"] = self.reference.load()
        return [ignored_mask_problem(whose) for whose, scorer in scorers.items()
                if ignores_loss_mask(lambda b, s=scorer: per_sample_loss(s, b), rows)]

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if self.reference_losses is None or stage != "fit":
            return
        self.table = ReferenceLossTable.read(self.reference_losses)
        splits = getattr(getattr(trainer, "datamodule", None), "splits", None)
        pool = splits.get("pool") if isinstance(splits, dict) else None
        if pool is not None:  # a PoolDataModule: its packed pool's fingerprint, before the first step
            self.table.check_pool(pool)

    @override
    def score(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: MutableMapping, batch_idx: int) -> torch.Tensor:
        if self.window_context and not self._mask_checked:  # no target rows at fit start: the first superbatch's
            self._mask_checked = True
            problems = self._mask_problems(pl_module, batch)
            if problems:
                raise ValueError(f"{type(self).__name__} cannot score windows in context:\n- " + "\n- ".join(problems))
        if self.score_len is not None:  # both models see the same window of each candidate
            batch = candidate_windows(batch, self.score_len, self.seed, trainer.current_epoch, batch_idx,
                                      trainer.global_rank, trainer.world_size, self.window_context)
        learner = learner_losses(pl_module, batch, self.meter).float()
        if self.table is not None:
            if not isinstance(batch.get("sample_id"), torch.Tensor):
                raise ValueError("reference_losses are looked up by sample_id: the superbatch carries none")
            reference = self.table.lookup(batch)
        else:
            reference = self.reference.losses(batch).float()
        self._mean_losses = (float(learner.mean()), float(reference.mean()))
        return learner - reference

    @override
    def extra_metrics(self) -> dict[str, float]:
        out = super().extra_metrics()
        if self._mean_losses is not None:
            out["select/learner_loss"], out["select/reference_loss"] = self._mean_losses
        return out
