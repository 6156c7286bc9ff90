"""``ProxySelection``: the common plumbing of the methods that score with models next to the learner.

ClassAct and RHO-LOSS score s(z) = ℓ_online(z) − ℓ_reference(z). This base runs their frozen
reference's whole lifecycle (:class:`~selection_callbacks.scoring.reference.Reference`): it reads a
given one when the fit is set up, places it (or builds one) on the learner's device and precision when
training starts (after a resume has restored its state), and trains a built one on the target split at
the first micro-batch, before that micro-batch is scored. It builds the methods' other proxies the same
way, counts every extra forward/backward in the base class's ``meter``, and logs the selection's share
of the step time.
"""

from __future__ import annotations

import time
from typing import Any, Literal

import lightning as L
import torch
import torch.nn as nn
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

from selection_callbacks.callbacks.base import SelectionCallback
from selection_callbacks.callbacks.protocols import needs_proxy_builder, needs_target_batch, wrapped_causal_lm
from selection_callbacks.nn.flops import matmul_flops_per_token
from selection_callbacks.nn.gpt import GPTConfig
from selection_callbacks.scoring.proxy_models import (
    Proxy,
    causal_lm_proxy_config,
    check_reference_fits,
    gpt_proxy_config,
    is_causal_lm_config,
    padded_vocab,
    seeded_proxy,
)
from selection_callbacks.scoring.reference import Reference


class ProxySelection(SelectionCallback):
    """Base of the proxy-model selection callbacks (:class:`ClassActSelection`, :class:`RhoLossSelection`).

    A subclass scores with :func:`~selection_callbacks.scoring.losses.learner_losses` (the learner's),
    ``self.reference.losses`` (its frozen reference, ready before :meth:`score` runs) and
    ``self.proxies[name].losses`` (the models it adds in :meth:`create_proxies` with :meth:`add_proxy`). A proxy
    is ``proxy_layers`` × ``proxy_width`` of the learner's architecture (:meth:`proxy_config`) with initial
    weights drawn from (seed, purpose) alone, or what an overridden :meth:`build_proxy` returns.

    The reference (``self.reference``, a :class:`Reference`; None when a subclass scores without one) is
    ``reference`` as given, trained (an ``nn.Module``, a Hugging Face model folder or a ``LitGPT`` /
    ``LitCausalLM`` checkpoint; a copy scores and it is never trained), or, without one,
    ``build_proxy(..., "reference")`` trained for ``reference_steps`` AdamW steps on
    ``reference_batch_size`` target rows per step at ``reference_lr``, then frozen (``reference_steps=0``
    scores it as built: a ``build_proxy`` that returns trained weights). To fine-tune a trained model,
    return a copy of it from ``build_proxy`` with ``reference_steps`` > 0. The training runs at the first
    micro-batch, before its scoring, so its time and passes count in the run's wall-clock, the summary's
    ``overhead_seconds`` and the cost metrics (as one-off ``reference_pretrain`` passes).

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
        reference: a trained reference (an ``nn.Module``, a Hugging Face model folder or a checkpoint);
            None: build one.
        reference_steps: target-split steps of a reference built here (unused with a given one).
        reference_batch_size: target rows per such step.
        reference_lr: the AdamW learning rate of those steps.
        uses_reference: whether the subclass scores with a frozen reference (False: ``self.reference`` is None).
        **fit_options: the base's fit options (``per_sample_keys``, ``whole_batch_keys``, ``strict_resume``,
            ``short_superbatch``; :class:`~selection_callbacks.callbacks.base.SelectionCallback`).

    Raises:
        ValueError: a ``reference`` while ``uses_reference`` is False, or bad sizes.
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
        reference: str | nn.Module | None = None,
        reference_steps: int = 300,
        reference_batch_size: int = 16,
        reference_lr: float = 2e-3,
        uses_reference: bool = True,
        **fit_options: Any,
    ) -> None:
        if sampling not in ("top_k", "gumbel"):
            raise ValueError(f"{type(self).__name__} samples by 'top_k' or 'gumbel', got {sampling!r}")
        super().__init__(ratio=ratio, k=k, sampling=sampling, temperature=temperature, seed=seed, nonfinite=nonfinite,
                         diagnostics_every=diagnostics_every, **fit_options)
        if min(proxy_layers, proxy_width, proxy_heads) < 1:
            raise ValueError("proxy_layers, proxy_width and proxy_heads must be ≥ 1")
        if reference_steps < 0 or reference_batch_size < 1:
            raise ValueError(
                f"need reference_steps ≥ 0 and reference_batch_size ≥ 1, got {reference_steps}, {reference_batch_size}"
            )
        if reference is not None and not uses_reference:
            raise ValueError(f"this {type(self).__name__} scores without a frozen reference: drop reference")
        self.proxy_layers, self.proxy_width, self.proxy_heads = proxy_layers, proxy_width, proxy_heads
        self.reference_steps, self.reference_batch_size, self.reference_lr = (
            reference_steps, reference_batch_size, reference_lr)
        self.reference = Reference(reference, reference_steps, reference_batch_size) if uses_reference else None
        self.proxies: dict[str, Proxy] = {}
        self._pending: dict[str, Any] | None = None  # the other proxies' checkpoint state, until they are built
        self._step_start: float | None = None
        self._last_selection = 0.0
        self._fraction: float | None = None

    # ---- what a method implements ----
    def create_proxies(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Add this method's models other than its reference with :meth:`add_proxy` (at train start; none here)."""

    def proxy_requirements(self, trainer: L.Trainer, pl_module: L.LightningModule, builds: bool) -> list[str]:
        """The needs of building this method's proxies (``builds``) and its reference (built: a proxy builder;
        trained here: the target split)."""
        dm, who, reference = getattr(trainer, "datamodule", None), type(self).__name__, self.reference
        builds = builds or (reference is not None and not reference.given)
        problems = needs_proxy_builder(self.builds_own_proxies, pl_module, dm, who) if builds else []
        if reference is not None and reference.trains:
            problems += needs_target_batch(dm, who, "pretrains its reference on the target split",
                                           "pass reference=CKPT, a Hugging Face model folder or a trained nn.Module")
        return problems

    @property
    def builds_own_proxies(self) -> bool:
        """Whether a subclass overrides :meth:`build_proxy` (its models need nothing of the learner's config)."""
        return type(self).build_proxy is not ProxySelection.build_proxy

    def build_proxy(self, trainer: L.Trainer, pl_module: L.LightningModule, purpose: str) -> nn.Module:
        """A fresh proxy whose initial weights depend only on (seed, purpose).

        Override to use another architecture: any ``nn.Module`` with ``per_sample_loss(batch) -> [N]``. For
        ``purpose="reference"`` it is the reference's starting point: trained for ``reference_steps`` steps
        on the target split, or scored as returned with ``reference_steps=0``.
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
        proxy = self._placed(trainer, pl_module, name, module, lr, persist)
        self.proxies[name] = proxy
        return proxy

    def _placed(self, trainer: L.Trainer, pl_module: L.LightningModule, name: str, module: nn.Module,
                lr: float | None, persist: bool) -> Proxy:
        module = trainer.precision_plugin.convert_module(module.to(pl_module.device))
        return Proxy(name, module, self.meter, lr, grad_scaling=trainer.precision == "16-mixed", persist=persist)

    def _place_reference(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Place the reference's model: the given one (its loaded copy, frozen) or ``build_proxy``'s, which trains
        at ``reference_lr`` until it has taken its steps (frozen at once with none)."""
        reference = self.reference
        if reference.given:
            module, lr = reference.load(), None
        else:
            module = self.build_proxy(trainer, pl_module, "reference")
            lr = self.reference_lr if reference.trains else None
            check_reference_fits(module, reference.describe(), _learner_vocab(pl_module), *_data_sizes(trainer))
        reference.place(self._placed(trainer, pl_module, "reference", module, lr, persist=not reference.given))

    def _make_reference_ready(self, trainer: L.Trainer) -> None:
        """Train a built reference its steps on the target split (once; under the learner's precision) and add
        the seconds to ``overhead_seconds``."""
        start = time.perf_counter()
        rank_zero_info(
            f"{type(self).__name__}: pretraining the reference for {self.reference.steps} steps on the target split"
        )
        with trainer.precision_plugin.train_step_context(), torch.enable_grad():
            self.reference.make_ready(getattr(trainer, "datamodule", None), self.seed)
        self.overhead_seconds += time.perf_counter() - start

    # ---- hooks ----
    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        reference = self.reference
        if reference is not None and reference.given and stage == "fit":  # an unfit reference fails before training
            module = reference.load()
            check_reference_fits(module, reference.describe(), _learner_vocab(pl_module), *_data_sizes(trainer),
                                 must_declare=True)
            rank_zero_info(f"{type(self).__name__}: scoring with {reference.describe()} as it is (never trained)")

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.proxies = {}
        if self.reference is not None:
            self._place_reference(trainer, pl_module)
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
        if self.reference is not None and not self.reference.ready:
            self._make_reference_ready(trainer)
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
        models = {**self.proxies}
        if self.reference is not None and self.reference.proxy is not None:
            models["reference"] = self.reference.proxy
        return {**super().flops_per_token(), **{name: matmul_flops_per_token(p.module) for name, p in models.items()}}

    # ---- checkpointing ----
    @override
    def state_dict(self) -> dict[str, Any]:
        proxies = {name: p.state_dict() for name, p in self.proxies.items()} if self.proxies else (self._pending or {})
        reference = None if self.reference is None else self.reference.state_dict()
        return {**super().state_dict(), "proxies": proxies, "reference": reference}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._pending = state_dict["proxies"]
        reference = state_dict.get("reference")
        if (reference is None) != (self.reference is None):
            raise ValueError(
                f"the checkpoint holds {'no' if reference is None else 'a'} frozen reference and this "
                f"{type(self).__name__} scores {'with' if self.reference is not None else 'without'} one: resume with "
                "the configuration the run was started with"
            )
        if self.reference is not None:
            self.reference.load_state_dict(reference)


def _learner_vocab(pl_module: L.LightningModule) -> int | None:
    """The learner's vocabulary size: ``config.vocab_size`` or ``vocab_size`` (None: it declares neither)."""
    config = getattr(pl_module, "config", None)
    for value in (getattr(config, "vocab_size", None), getattr(pl_module, "vocab_size", None)):
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def _data_sizes(trainer: L.Trainer) -> tuple[int | None, int | None]:
    """The datamodule's ``vocab_size`` and ``seq_len`` (None where it has none)."""
    dm = getattr(trainer, "datamodule", None)
    return getattr(dm, "vocab_size", None), getattr(dm, "seq_len", None)


def warn_wrapped_causal_lm(pl_module: L.LightningModule, who: str) -> None:
    """Warn when the learner holds a Hugging Face causal LM without exposing its ``config``: the proxies then fall
    back to the plugin's GPT (:func:`~selection_callbacks.callbacks.protocols.wrapped_causal_lm`)."""
    warning = wrapped_causal_lm(pl_module, who)
    if warning is not None:
        rank_zero_warn(warning)
