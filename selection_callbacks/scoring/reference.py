"""The frozen reference of RHO-LOSS and ClassAct: where it comes from, its model, and whether it is ready to score.

A reference is given trained, in one of three forms, or built by the method and trained on the target split:

- an ``nn.Module`` (kind ``"module"``) with the learner's vocabulary that scores either through
  ``per_sample_loss(batch) -> [N]`` (a ``LitGPT``, a ``LitCausalLM``, any LightningModule of the
  per-sample loss protocol) or through ``forward(input_ids [N, T])`` returning logits [N, T, V] or an
  output with ``.logits`` (a Hugging Face model, a plain GPT), scored as the mean next-token loss of
  each row (:class:`LogitsLM`). It declares its vocabulary as ``vocab_size`` or ``config.vocab_size``.
  A copy scores: the module handed over is left as it is (weights, device, dtype, ``requires_grad``);
- a Hugging Face model folder written by ``save_pretrained`` (kind ``"folder"``; safetensors only);
- a checkpoint of a ``LitLanguageModel`` (``train.py``'s ``LitGPT`` or ``LitCausalLM``, kind
  ``"checkpoint"``), read as data (:mod:`~selection_callbacks.scoring.reference_files`).

A given reference is never trained. A built one (kind ``"built"``: the method's ``build_proxy``) takes
``steps`` AdamW steps on target batches before the first selection and is frozen after; ``steps=0``
scores it as built (a ``build_proxy`` that returns trained weights). To fine-tune a trained model on the
target split, return a copy of it from ``build_proxy`` with ``steps`` > 0.

:class:`Reference` holds all of it: the source and its kind, the scoring :class:`Proxy` once placed on
the learner's device, whether it is ready, and its checkpoint state.
"""

from __future__ import annotations

import copy
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn as nn

from selection_callbacks.core.costs import CostMeter
from selection_callbacks.nn.gpt import GPTConfig
from selection_callbacks.scoring.losses import PerSampleLoss, sequence_means, token_losses
from selection_callbacks.scoring.proxy_models import (
    Proxy,
    ProxyLM,
    is_causal_lm_config,
    pretrain_on_target,
    seeded_proxy,
)
from selection_callbacks.scoring.reference_files import read_checkpoint, read_pretrained_folder

__all__ = ["LogitsLM", "Reference", "ReferenceKind", "load_reference", "pretrained_reference", "source_kind"]

ReferenceKind = Literal["module", "folder", "checkpoint", "built"]
Source = str | Path | nn.Module | None


class LogitsLM(nn.Module):
    """A causal LM given as ``input_ids`` [N, T] → logits [N, T, V] with the per-sample loss protocol.

    ``per_sample_loss(batch)`` is the mean token loss of each row (:func:`token_losses`: ``labels`` or
    ``input_ids`` shifted by one, ``loss_mask`` honoured), like the learners'. A Hugging Face model is
    called as ``model(input_ids=..., use_cache=False)`` and its ``.logits`` are read.

    Example::

        scorer = LogitsLM(AutoModelForCausalLM.from_config(config))
        losses = scorer.per_sample_loss({"input_ids": ids})  # [N]
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.config = getattr(model, "config", None)
        self.vocab_size = getattr(model, "vocab_size", None)

    def per_sample_loss(self, batch: MutableMapping) -> torch.Tensor:
        ids = batch["input_ids"]
        out = self.model(input_ids=ids, use_cache=False) if is_causal_lm_config(self.config) else self.model(ids)
        logits = getattr(out, "logits", out)
        if not isinstance(logits, torch.Tensor) or logits.ndim != 3:
            raise TypeError(f"the reference {type(self.model).__name__} returned {type(out).__name__} from forward("
                            "input_ids); a reference returns logits [N, T, V] (or an output with .logits) or has "
                            "per_sample_loss(batch) -> Tensor[N]")
        nll, mask, _ = token_losses(logits, batch)
        return sequence_means(nll, mask)


def load_reference(source: str | Path | nn.Module) -> nn.Module:
    """The scoring module of a given reference: frozen, eval mode, with ``per_sample_loss(batch) -> [N]``.

    Args:
        source: an ``nn.Module`` (copied: the original is left as it is; wrapped in :class:`LogitsLM` when it
            has no ``per_sample_loss``), a Hugging Face ``save_pretrained`` folder, or a ``LitGPT``/``LitCausalLM``
            checkpoint file (both read on CPU without running pickled code).

    Raises:
        FileNotFoundError: no such file or folder.
        UnsafeLoadError: a checkpoint that needs the full pickle loader.
        ValueError: a file or folder that holds no reference (the message says what it lacks).
        TypeError: ``source`` is neither a module nor a path.

    Example::

        reference = load_reference("runs/reference/checkpoints/last.ckpt")
        losses = reference.per_sample_loss({"input_ids": ids})  # [N]
    """
    if isinstance(source, nn.Module):
        module = copy.deepcopy(source)
    elif isinstance(source, (str, Path)):
        path = Path(source)
        if not path.exists():
            raise FileNotFoundError(f"reference checkpoint {str(source)!r} does not exist: pass a train.py checkpoint "
                                    "(a file) or a Hugging Face model folder (save_pretrained)")
        module = read_pretrained_folder(path) if path.is_dir() else read_checkpoint(path)
    else:
        raise TypeError(f"a reference is an nn.Module, a Hugging Face model folder or a checkpoint path, got "
                        f"{type(source).__name__}")
    if not isinstance(module, PerSampleLoss):
        module = LogitsLM(module)
    return module.eval().requires_grad_(False)


def source_kind(source: Source) -> ReferenceKind:
    """``"built"`` (None), ``"module"``, ``"folder"`` (an existing directory) or ``"checkpoint"`` (any other path)."""
    if source is None:
        return "built"
    if isinstance(source, nn.Module):
        return "module"
    return "folder" if Path(source).is_dir() else "checkpoint"


class Reference:
    """One frozen reference: its source and kind, its scoring :class:`Proxy`, whether it is ready, its state.

    Lifecycle (:class:`~selection_callbacks.methods.bases.proxy.ProxySelection` runs it, so a method
    only scores with :meth:`losses`): :meth:`load` reads a given reference when the fit is set up (a
    missing or unsafe file fails before training); :meth:`place` takes its proxy on the learner's
    device when training starts; :meth:`make_ready` trains a built one its ``steps`` on the target
    split at the first micro-batch, before its scoring, and freezes it. A given reference is ready
    once placed and is never trained.

    Args:
        source: a trained ``nn.Module``, a Hugging Face model folder, a ``LitLanguageModel`` checkpoint, or
            None: the method builds one (``build_proxy``).
        steps: AdamW steps a built reference takes on the target split (0: scored as built); a given one takes 0.
        batch_size: target rows per step.

    Example::

        reference = Reference("runs/reference/reference.ckpt", steps=0)
        reference.load()
        reference.place(Proxy("reference", reference.module, CostMeter()))
        losses = reference.losses(batch)  # [N]
    """

    def __init__(self, source: Source, steps: int, batch_size: int = 16) -> None:
        self.source, self.kind = source, source_kind(source)
        self.steps = 0 if self.given else steps
        self.batch_size = batch_size
        self.module: nn.Module | None = None  # a given reference's scoring module, once loaded
        self.proxy: Proxy | None = None  # the placed model (device, precision, optimizer while training)
        self._restored: dict[str, Any] | None = None  # a checkpoint's state, applied when placed

    @property
    def given(self) -> bool:
        """Whether the reference came trained (a module, folder or checkpoint) rather than built here."""
        return self.kind != "built"

    @property
    def trains(self) -> bool:
        """Whether it takes steps on the target split before the first selection (a built one with steps > 0)."""
        return self.steps > 0

    @property
    def ready(self) -> bool:
        """Placed and frozen: it scores and never changes again."""
        return self.proxy is not None and self.proxy.frozen

    def describe(self) -> str:
        """Where it comes from, in words (for logs and errors)."""
        if self.kind == "module":
            return f"the {type(self.source).__name__} module given as the reference"
        if self.kind == "built":
            return f"the reference built here ({self.steps} steps on the target split)"
        return f"the reference {self.kind} {str(self.source)!r}"

    def load(self) -> nn.Module | None:
        """Read a given reference (:func:`load_reference`) once; None for a built one (its proxy comes at placement)."""
        if self.given and self.module is None:
            self.module = load_reference(self.source)
        return self.module

    def place(self, proxy: Proxy) -> None:
        """Hold ``proxy`` as the scoring model, with the state a checkpoint restored (if any)."""
        self.proxy = proxy
        if self._restored is not None:
            proxy.load_state_dict(self._restored["proxy"])
            self._restored = None

    def make_ready(self, datamodule: object, seed: int) -> bool:
        """Train a placed, built reference its remaining steps on ``datamodule.target_batch`` rows, then freeze it.

        Batch ``s`` is drawn from (seed, s) (:func:`pretrain_on_target`): the same reference on every rank
        and rerun. Returns whether it trained now (False: it was ready).
        """
        if self.proxy is None:
            raise RuntimeError(f"{self.describe()} is not placed yet: place() it on the learner's device first")
        if self.ready:
            return False
        pretrain_on_target(self.proxy, datamodule, self.steps, self.batch_size, seed)
        return True

    def losses(self, batch: MutableMapping) -> torch.Tensor:
        """[N] the reference's per-sample losses (:meth:`Proxy.losses`); an error before it is ready."""
        if not self.ready:
            raise RuntimeError(f"{self.describe()} is not ready: ProxySelection places it in on_train_start and "
                               "makes it ready in on_train_batch_start; a subclass that overrides them calls super()")
        return self.proxy.losses(batch)

    def state_dict(self) -> dict[str, Any]:
        """Its kind and its proxy's state (the weights only for a built reference; a given one is read again)."""
        if self.proxy is None:
            return self._restored or {"kind": self.kind, "proxy": None}
        return {"kind": self.kind, "proxy": self.proxy.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a checkpoint's state (now when placed, else at :meth:`place`).

        Raises:
            ValueError: the checkpoint's reference is of another kind than this one.
        """
        if state["kind"] != self.kind:
            raise ValueError(f"the checkpoint's reference is of kind {state['kind']!r} and {self.describe()} is of "
                             f"kind {self.kind!r}: resume with the reference the run was started with")
        self._restored = state if state["proxy"] is not None else None
        if self.proxy is not None and self._restored is not None:
            self.place(self.proxy)


def pretrained_reference(datamodule: object, config: GPTConfig | Any, steps: int, batch_size: int, lr: float,
                         seed: int) -> ProxyLM | nn.Module:
    """The reference RHO-LOSS (and ClassAct's paper variant) builds when given none, built outside a run.

    The proxy of (``seed``, "reference") with ``config`` (the selector's ``proxy_config``), trained for
    ``steps`` AdamW steps at ``lr`` on ``datamodule.target_batch`` draws seeded as in the run: the same
    weights as the live reference, so a table of its losses selects as the live run does.
    """
    proxy = Proxy("reference", seeded_proxy(config, seed, "reference"), CostMeter(), lr)
    pretrain_on_target(proxy, datamodule, steps, batch_size, seed)
    return proxy.module
