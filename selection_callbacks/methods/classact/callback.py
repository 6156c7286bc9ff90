"""ClassAct: learnability selection, s(z) = ℓ_online(z) − ℓ_reference(z)."""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any, Literal

import lightning as L
import torch
import torch.nn as nn
from typing_extensions import override

from selection_callbacks.callbacks.protocols import needs_per_sample_loss
from selection_callbacks.core.selection import SelectionRecord
from selection_callbacks.methods.bases.proxy import ProxySelection
from selection_callbacks.scoring.losses import learner_losses
from selection_callbacks.scoring.windows import candidate_windows


class ClassActSelection(ProxySelection):
    """Keep the candidates the reference has learned and the online model has not yet.

    Score s(z) = ℓ_online(z) − ℓ_reference(z) per candidate z ([N] mean token losses), K chosen
    by top-K or Gumbel-top-K at ``temperature`` (Evans et al. 2023, "Bad students make great
    teachers"; the LM adaptation of the data-selection report). Two variants:

    - ``"paper"``: the reference is frozen and trained on the target split: a trained model given
      as ``reference`` (an ``nn.Module`` with the learner's vocabulary, a Hugging Face model folder or a
      ``LitGPT``/``LitCausalLM`` checkpoint; a copy scores and it is never trained, see
      :class:`~selection_callbacks.scoring.reference.Reference`), or ``build_proxy(..., "reference")``
      pretrained at ``reference_lr_scale · proxy_lr`` for ``reference_steps`` steps of
      ``reference_batch_size`` target sequences before the first selection (``reference_steps=0``:
      scored as an overridden ``build_proxy`` returns it). The online model (the actor) is a proxy
      trained at ``proxy_lr`` on the selected rows (``online="proxy"``, as in the paper) or the
      learner itself (``online="learner"``, no extra model; the score is then RHO-LOSS's).
    - ``"report"``: two proxies of the same initial weights, trained on every micro-batch:
      the online one at ``proxy_lr`` on the K selected rows (it stands in for the learner, which
      trains on them), the reference at ``reference_lr_scale · proxy_lr`` on all N candidates.
      A high score then means the faster learner has learned z more. Per micro-batch this costs
      an online forward over N plus a forward/backward over K, and a reference forward over N
      plus a forward/backward over N: the report's "online 3 fwd + 1 bwd, reference 3 fwd +
      3 bwd" at ρ = 1/3, plus the training forwards (logged as ``select/cost/*``).

    Every proxy is ``proxy_layers`` × ``proxy_width`` of the learner's architecture
    (:meth:`ProxySelection.proxy_config`: a Hugging Face learner's own, else the plugin's GPT) or
    what an overridden ``build_proxy`` returns. Proxies train on the global candidate rows
    (``SelectionRecord.batch``), so under DDP every rank holds the same proxies. They step once per
    micro-batch with AdamW (betas 0.9/0.95, no weight decay, constant learning rate), run under the
    learner's precision, and are saved with the callback's state (weights, optimizer states, step
    counters).

    With ``score_len`` = L every model scores the same seeded random L-token window of each candidate
    (RHO-LOSS's windows: [N, L] rows instead of [N, T]) and the online proxies train on those windows of their
    rows (the actor on the K selected ones, the report's reference on all N), so every proxy pass reads L/T of
    the tokens and the proxies learn the windows they score.

    Example::

        trainer = L.Trainer(callbacks=[ClassActSelection(ratio=1 / 3, variant="report")])

    Args:
        ratio: kept fraction ρ = K/N.
        variant: ``"paper"`` (frozen reference) or ``"report"`` (both proxies trained online, no
            target split needed).
        online: ``"proxy"`` (the actor) or ``"learner"``: set ``"learner"`` to skip the actor's cost
            when scoring with the learner's own loss is wanted; the report variant takes ``"proxy"`` only.
        reference: paper variant: a reference trained on the target split, as an ``nn.Module``, a Hugging
            Face model folder or a checkpoint (the RHO-LOSS method card has the command); None: pretrain one.
        reference_steps: paper variant without ``reference``: pretraining steps on the target split.
        reference_batch_size: target sequences per pretraining step.
        proxy_layers: layers of the proxies built here.
        proxy_width: their width; vocabulary and context follow the learner.
        proxy_heads: their attention heads; set it when ``proxy_width`` is not a multiple of 4.
        proxy_lr: learning rate of the online proxy.
        reference_lr_scale: the reference learns at this multiple of ``proxy_lr``.
        score_len: score (and train the online proxies on) a seeded random window of this many tokens per
            candidate (None: the whole sequence): set it to cut the proxies' passes when T is long.
        sampling: ``"top_k"`` or ``"gumbel"``: set ``"gumbel"`` to draw K by score rather than take the top K.
        temperature: Gumbel-top-K temperature in nats.
        seed: selection seed; also draws the proxies' initial weights and pretraining batches.
        k: keep exactly this many instead of ratio·N: set it to fix K whatever the superbatch size.
        nonfinite: see :class:`SelectionCallback`.
        **fit_options: the base's fit options (``per_sample_keys``, ``whole_batch_keys``, ``strict_resume``,
            ``short_superbatch``; :class:`~selection_callbacks.callbacks.base.SelectionCallback`).
    """

    supported_stack = ProxySelection.FULL_STACK

    def __init__(
        self,
        ratio: float = 0.5,
        variant: Literal["paper", "report"] = "paper",
        online: Literal["proxy", "learner"] = "proxy",
        reference: str | nn.Module | None = None,
        reference_steps: int = 300,
        reference_batch_size: int = 16,
        proxy_layers: int = 2,
        proxy_width: int = 128,
        proxy_heads: int = 4,
        proxy_lr: float = 1e-3,
        reference_lr_scale: float = 2.0,
        score_len: int | None = None,
        sampling: Literal["top_k", "gumbel"] = "top_k",
        temperature: float = 1.0,
        seed: int = 0,
        k: int | None = None,
        nonfinite: Literal["error", "lowest"] = "error",
        **fit_options: Any,
    ) -> None:
        if variant not in ("paper", "report"):
            raise ValueError(f"variant must be 'paper' or 'report', got {variant!r}")
        if online not in ("proxy", "learner"):
            raise ValueError(f"online must be 'proxy' or 'learner', got {online!r}")
        if variant == "report" and (online == "learner" or reference is not None):
            raise ValueError(
                "the report variant trains both proxies online: it takes neither online='learner' nor a reference"
            )
        if variant == "paper" and reference is None and reference_steps == 0 and not self.builds_own_proxies:
            raise ValueError(
                "ClassAct's paper variant needs a reference: reference= a trained nn.Module, a Hugging Face model "
                "folder or a train.py checkpoint; reference_steps > 0 to pretrain one on the target split; or "
                "reference_steps=0 with build_proxy() overridden to return a trained one"
            )
        if score_len is not None and score_len < 1:
            raise ValueError(f"score_len must be ≥ 1 or None (the whole sequence), got {score_len}")
        if not (proxy_lr > 0 and reference_lr_scale > 0):
            raise ValueError(f"proxy_lr and reference_lr_scale must be > 0, got {proxy_lr}, {reference_lr_scale}")
        super().__init__(
            ratio=ratio, k=k, sampling=sampling, temperature=temperature, seed=seed, nonfinite=nonfinite,
            proxy_layers=proxy_layers, proxy_width=proxy_width, proxy_heads=proxy_heads, reference=reference,
            reference_steps=reference_steps, reference_batch_size=reference_batch_size,
            reference_lr=proxy_lr * reference_lr_scale, uses_reference=variant == "paper", **fit_options,
        )
        self.variant = variant
        self.online = online
        self.proxy_lr, self.reference_lr_scale = proxy_lr, reference_lr_scale
        self.score_len = score_len
        self._mean_losses: tuple[float, float] | None = None

    @override
    def requirements(self, trainer: L.Trainer, pl_module: L.LightningModule) -> list[str]:
        problems = needs_per_sample_loss(pl_module, type(self).__name__) if self.online == "learner" else []
        return problems + self.proxy_requirements(trainer, pl_module, builds=self.online == "proxy")

    @override
    def create_proxies(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.variant == "report":  # same initial weights: the score is what the faster learner learned more
            self.add_proxy(trainer, pl_module, "online", self.build_proxy(trainer, pl_module, "proxy"), self.proxy_lr)
            self.add_proxy(trainer, pl_module, "reference", self.build_proxy(trainer, pl_module, "proxy"),
                           self.reference_lr)
        elif self.online == "proxy":
            self.add_proxy(trainer, pl_module, "online", self.build_proxy(trainer, pl_module, "online"), self.proxy_lr)

    def windows(self, trainer: L.Trainer, rows: MutableMapping, batch_idx: int, global_rows: bool) -> MutableMapping:
        """``rows`` cut to the micro-batch's seeded ``score_len`` windows (``rows`` itself without ``score_len``).

        ``global_rows``: ``rows`` are the global W·N candidates (``SelectionRecord.batch``), else this rank's N; a
        candidate gets the same window either way.
        """
        if self.score_len is None:
            return rows
        rank, world_size = (0, 1) if global_rows else (trainer.global_rank, trainer.world_size)
        return candidate_windows(rows, self.score_len, self.seed, trainer.current_epoch, batch_idx, rank, world_size)

    @override
    def score(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: MutableMapping, batch_idx: int) -> torch.Tensor:
        batch = self.windows(trainer, batch, batch_idx, global_rows=False)
        if self.online == "proxy":
            online = self.proxies["online"].losses(batch)
        else:
            online = learner_losses(pl_module, batch, self.meter)
        if self.reference is not None:  # the paper variant's frozen reference
            reference = self.reference.losses(batch)
        else:  # the report variant's reference proxy, trained on every micro-batch
            reference = self.proxies["reference"].losses(batch)
        self._mean_losses = (float(online.float().mean()), float(reference.float().mean()))
        return online.float() - reference.float()

    @override
    def after_selection(self, trainer: L.Trainer, pl_module: L.LightningModule, record: SelectionRecord) -> None:
        rows = self.windows(trainer, record.batch, record.micro_batch, global_rows=True)
        with trainer.precision_plugin.train_step_context():
            if self.online == "proxy":
                self.proxies["online"].train_step({key: v[record.selected.to(v.device)] for key, v in rows.items()})
            if self.variant == "report":
                self.proxies["reference"].train_step(rows)

    @override
    def extra_metrics(self) -> dict[str, float]:
        out = super().extra_metrics()
        if self._mean_losses is not None:
            out["select/online_loss"], out["select/reference_loss"] = self._mean_losses
        return out
