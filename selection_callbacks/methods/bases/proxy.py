"""``ProxySelection``: the shared plumbing of the methods that score with models next to the learner.

ClassAct and RHO-LOSS score s(z) = ℓ_online(z) − ℓ_reference(z). This base builds their proxies
on the learner's device and precision when training starts (after a resume has restored their
state), pretrains a frozen reference on the target split when no reference checkpoint is given,
counts every extra forward/backward in the base class's ``meter``, and logs the selection's share of
the step time.
"""

from __future__ import annotations

import time
from abc import abstractmethod
from collections.abc import MutableMapping
from typing import Any, Literal

import lightning as L
import torch
import torch.nn as nn
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

from selection_callbacks.callbacks.base import SelectionCallback
from selection_callbacks.callbacks.protocols import needs_proxy_builder, needs_target_batch, wrapped_causal_lm
from selection_callbacks.scoring.reference import load_reference
from selection_callbacks.nn.flops import matmul_flops_per_token
from selection_callbacks.nn.gpt import GPTConfig
from selection_callbacks.scoring.losses import per_sample_loss
from selection_callbacks.scoring.proxy_models import (
    Proxy,
    causal_lm_proxy_config,
    check_reference_fits,
    gpt_proxy_config,
    is_causal_lm_config,
    padded_vocab,
    pretrain_on_target,
    seeded_proxy,
)


class ProxySelection(SelectionCallback):
    """Base of the proxy-model selection callbacks (:class:`ClassActSelection`, :class:`RhoLossSelection`).

    Subclasses add their models in :meth:`create_proxies` (with :meth:`add_proxy` and
    :meth:`add_reference`) and score with :meth:`learner_losses` and ``self.proxies[name].losses``.
    A proxy is ``proxy_layers`` × ``proxy_width`` of the learner's architecture (:meth:`proxy_config`)
    with initial weights drawn from (seed, purpose) alone, or what an overridden :meth:`build_proxy`
    returns. The frozen reference is the GPT of ``reference`` (a ``train.py`` checkpoint) or, without
    one, a fresh proxy pretrained for ``reference_steps`` AdamW steps on ``reference_batch_size`` target
    sequences per step. The pretraining runs in the first scoring call, so its time and passes count
    in the run's wall-clock, ``select/overhead_ms`` and the cost metrics.

    Extra metrics per micro-batch: ``select/cost/<model>_<fwd|bwd>[_tokens][_total]`` (passes and
    tokens of ``learner`` scoring, ``online`` and ``reference``; this micro-batch and cumulative,
    this process's work), ``select/cost/{fwd,bwd}_per_update`` (extra tokens over the K·T the
    learner trains on) and ``select/scoring_fraction`` (the previous micro-batch's scoring and proxy
    training over the time between it and this one's ``on_train_batch_start``; not logged right
    after validation).

    Args:
        ratio, k, sampling, temperature, seed, nonfinite, diagnostics_every: see :class:`SelectionCallback`.
        proxy_layers: layers of the proxies this callback builds.
        proxy_width: their width (n_embd); vocabulary and context follow the learner.
        proxy_heads: their attention heads; set it when ``proxy_width`` is not a multiple of 4.
        reference: a reference checkpoint (``train.py`` on the target split); None: pretrain one.
        reference_steps: pretraining steps of the reference when ``reference`` is None.
        reference_batch_size: target sequences per pretraining step.
    """

    def __init__(
        self,
        ratio: float = 0.5,
        k: int | None = None,
        sampling: Literal["top_k", "gumbel"] = "top_k",
        temperature: float = 1.0,
        seed: int = 0,
        nonfinite: Literal["error", "lowest"] = "error",
        diagnostics_every: int = 100,
        proxy_layers: int = 2,
        proxy_width: int = 128,
        proxy_heads: int = 4,
        reference: str | None = None,
        reference_steps: int = 300,
        reference_batch_size: int = 16,
    ) -> None:
        if sampling not in ("top_k", "gumbel"):
            raise ValueError(f"{type(self).__name__} samples by 'top_k' or 'gumbel', got {sampling!r}")
        super().__init__(ratio=ratio, k=k, sampling=sampling, temperature=temperature, seed=seed, nonfinite=nonfinite,
                         diagnostics_every=diagnostics_every)
        if min(proxy_layers, proxy_width, proxy_heads) < 1:
            raise ValueError("proxy_layers, proxy_width and proxy_heads must be ≥ 1")
        if reference_steps < 0 or reference_batch_size < 1:
            raise ValueError(
                f"need reference_steps ≥ 0 and reference_batch_size ≥ 1, got {reference_steps}, {reference_batch_size}"
            )
        self.proxy_layers, self.proxy_width, self.proxy_heads = proxy_layers, proxy_width, proxy_heads
        self.reference = reference
        self.reference_steps, self.reference_batch_size = reference_steps, reference_batch_size
        self.proxies: dict[str, Proxy] = {}
        self._to_pretrain: Proxy | None = None
        self._loaded_reference: nn.Module | None = None
        self._pending: dict[str, Any] | None = None
        self._step_start: float | None = None
        self._last_selection = 0.0
        self._fraction: float | None = None

    # ---- what a method implements ----
    @abstractmethod
    def create_proxies(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Add this method's models with :meth:`add_proxy` / :meth:`add_reference` (called at train start)."""

    def proxy_requirements(
        self, trainer: L.Trainer, pl_module: L.LightningModule, builds: bool, pretrains: bool
    ) -> list[str]:
        """The needs of building proxies (``builds``) and pretraining a reference on the target split (``pretrains``)."""
        dm, who = getattr(trainer, "datamodule", None), type(self).__name__
        overridden = type(self).build_proxy is not ProxySelection.build_proxy
        problems = needs_proxy_builder(overridden, pl_module, dm, who) if builds else []
        if pretrains:
            problems += needs_target_batch(dm, who, "pretrains its reference on the target split",
                                           "pass reference=CKPT (train.py on the target split)")
        return problems

    def build_proxy(self, trainer: L.Trainer, pl_module: L.LightningModule, purpose: str) -> nn.Module:
        """A fresh proxy whose initial weights depend only on (seed, purpose).

        Override to use another architecture: any ``nn.Module`` with ``per_sample_loss(batch) -> [N]``.
        """
        return seeded_proxy(self.proxy_config(trainer, pl_module), self.seed, purpose)

    def proxy_config(self, trainer: L.Trainer, pl_module: L.LightningModule) -> Any:
        """The proxies' architecture at ``proxy_layers`` × ``proxy_width`` with ``proxy_heads`` heads.

        The first that applies: the learner's own transformers architecture and vocabulary when
        ``pl_module.config`` is a Hugging Face ``PretrainedConfig`` (:func:`causal_lm_proxy_config`);
        the plugin's GPT with the vocabulary and context of the learner's :class:`GPTConfig`; that GPT
        with the datamodule's ``vocab_size`` (rounded up to 64) and ``seq_len``.

        Raises:
            ValueError: none applies (the message names the three ways and :meth:`build_proxy`).
        """
        learner = getattr(pl_module, "config", None)
        if is_causal_lm_config(learner):
            return causal_lm_proxy_config(learner, self.proxy_layers, self.proxy_width, self.proxy_heads)
        warn_wrapped_causal_lm(pl_module, type(self).__name__)
        if isinstance(learner, GPTConfig):
            vocab, block = learner.vocab_size, learner.block_size
        else:
            dm = getattr(trainer, "datamodule", None)
            problems = needs_proxy_builder(False, pl_module, dm, type(self).__name__)
            if problems:
                raise ValueError(problems[0])
            vocab, block = padded_vocab(dm.vocab_size), dm.seq_len
        return gpt_proxy_config(vocab, block, self.proxy_layers, self.proxy_width, self.proxy_heads)

    # ---- building blocks for subclasses ----
    def add_proxy(self, trainer: L.Trainer, pl_module: L.LightningModule, name: str, module: nn.Module,
                  lr: float | None, persist: bool = True) -> Proxy:
        """Register ``module`` as proxy ``name`` on the learner's device and precision (``lr=None``: frozen)."""
        module = trainer.precision_plugin.convert_module(module.to(pl_module.device))
        proxy = Proxy(name, module, self.meter, lr, grad_scaling=trainer.precision == "16-mixed", persist=persist)
        self.proxies[name] = proxy
        return proxy

    def add_reference(self, trainer: L.Trainer, pl_module: L.LightningModule, lr: float) -> Proxy:
        """The frozen reference: the checkpoint's model, or a fresh proxy pretrained at ``lr`` at the first scoring."""
        if self._loaded_reference is not None:
            return self.add_proxy(trainer, pl_module, "reference", self._loaded_reference, lr=None, persist=False)
        module = self.build_proxy(trainer, pl_module, "reference")
        self._to_pretrain = self.add_proxy(trainer, pl_module, "reference", module, lr)
        return self._to_pretrain

    def ensure_reference(self, trainer: L.Trainer) -> None:
        """Pretrain the reference on the target split if it still needs it (the first scoring call)."""
        proxy = self._to_pretrain
        if proxy is None or proxy.frozen:
            return
        rank_zero_info(
            f"{type(self).__name__}: pretraining the reference for {self.reference_steps} steps on the target split"
        )
        with torch.enable_grad():
            pretrain_on_target(proxy, getattr(trainer, "datamodule", None), self.reference_steps,
                               self.reference_batch_size, self.seed)

    def learner_losses(self, pl_module: L.LightningModule, batch: MutableMapping) -> torch.Tensor:
        """[N] the learner's per-sample losses (one counted forward)."""
        out = per_sample_loss(pl_module, batch)
        self.meter.add("learner", "fwd", batch["input_ids"].numel())
        return out

    # ---- hooks ----
    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self.reference is not None and stage == "fit":  # a missing or unfit checkpoint fails before training
            dm = getattr(trainer, "datamodule", None)
            self._loaded_reference = load_reference(self.reference)
            check_reference_fits(self._loaded_reference, getattr(dm, "vocab_size", None), getattr(dm, "seq_len", None),
                                 f"reference {self.reference!r}")

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.proxies, self._to_pretrain = {}, None
        self.create_proxies(trainer, pl_module)
        if self._pending is not None:
            if set(self._pending) != set(self.proxies):
                raise ValueError(
                    f"the checkpoint holds proxies {sorted(self._pending)}, this {type(self).__name__} builds "
                    f"{sorted(self.proxies)}: resume with the configuration the run was started with"
                )
            for name, state in self._pending.items():
                self.proxies[name].load_state_dict(state)
            self._pending = None

    @override
    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        start = time.perf_counter()
        self._fraction = None if self._step_start is None else self._last_selection / (start - self._step_start)
        self._step_start = start
        self.meter.new_step()
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)
        self._last_selection = time.perf_counter() - start

    @override
    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._step_start = None  # validation time is not step time

    @override
    def extra_metrics(self) -> dict[str, float]:
        record = self.last_record
        kept_tokens = 0 if record is None or self.last_selected is None else (
            self.last_selected.numel() * record.batch["input_ids"].shape[1])
        out = self.meter.metrics(kept_tokens)
        if self._fraction is not None:
            out["select/scoring_fraction"] = self._fraction
        return out

    @override
    def flops_per_token(self) -> dict[str, int]:
        return {**super().flops_per_token(), **{name: matmul_flops_per_token(p.module) for name, p in self.proxies.items()}}

    # ---- checkpointing ----
    @override
    def state_dict(self) -> dict[str, Any]:
        proxies = {name: p.state_dict() for name, p in self.proxies.items()} if self.proxies else (self._pending or {})
        return {**super().state_dict(), "proxies": proxies}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._pending = state_dict["proxies"]


def warn_wrapped_causal_lm(pl_module: L.LightningModule, who: str) -> None:
    """Warn when the learner holds a Hugging Face causal LM without exposing its ``config``: the proxies then fall
    back to the plugin's GPT (:func:`~selection_callbacks.callbacks.protocols.wrapped_causal_lm`)."""
    warning = wrapped_causal_lm(pl_module, who)
    if warning is not None:
        rank_zero_warn(warning)
