"""Small proxy language models next to the learner: build, train one step, count the cost, checkpoint.

A proxy is any ``nn.Module`` with the per-sample loss protocol (``per_sample_loss(batch) -> [N]``):
:class:`ProxyLM`, a :class:`selection_callbacks.nn.gpt.GPT` of its own shape, or :class:`CausalLMProxy`, a
Hugging Face causal LM of the learner's architecture at the proxy's size (:func:`causal_lm_proxy_config`;
transformers is imported only when the learner is one). :class:`Proxy` pairs a module with its AdamW
optimizer and step counter (or none: a frozen reference), and every forward or backward it runs is
counted in a :class:`CostMeter`.
"""

from __future__ import annotations

import math
import sys
from collections.abc import MutableMapping
from typing import Any

import numpy as np
import torch
import torch.nn as nn

from selection_callbacks.core.costs import CostMeter
from selection_callbacks.core.rng import derived_seed
from selection_callbacks.nn.gpt import GPT, GPTConfig
from selection_callbacks.scoring.losses import per_sample_loss, sequence_means, token_losses

__all__ = [
    "CausalLMProxy", "Proxy", "ProxyLM", "causal_lm_proxy_config", "check_reference_fits", "gpt_proxy_config",
    "initialised_proxy", "is_causal_lm_config", "padded_vocab", "pretrain_on_target", "reference_context", "reference_vocab",
    "seeded_proxy",
]


class ProxyLM(nn.Module):
    """A GPT with the per-sample loss protocol: ``per_sample_loss(batch)`` → [N] mean token loss (``loss_mask``)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.model = GPT(config)

    def per_sample_loss(self, batch: MutableMapping) -> torch.Tensor:
        nll, mask, _ = token_losses(self.model(batch["input_ids"]), batch)
        return sequence_means(nll, mask)


class CausalLMProxy(nn.Module):
    """A Hugging Face causal LM with the per-sample loss protocol: ``per_sample_loss(batch)`` → [N] mean token loss.

    The model is ``AutoModelForCausalLM.from_config(config)`` (random init, nothing downloaded); the loss
    is :func:`token_losses` of its logits, averaged over each row's ``loss_mask`` like :class:`ProxyLM`'s.

    Args:
        config: a transformers ``PretrainedConfig`` of a causal LM (e.g. from :func:`causal_lm_proxy_config`).

    Example::

        proxy = CausalLMProxy(causal_lm_proxy_config(learner.config, layers=2, width=128, heads=4))
        losses = proxy.per_sample_loss({"input_ids": ids})  # [N]
    """

    def __init__(self, config: Any) -> None:
        super().__init__()
        from transformers import AutoModelForCausalLM  # a learner of this architecture has loaded transformers

        self.config = config
        self.model = AutoModelForCausalLM.from_config(config)

    def per_sample_loss(self, batch: MutableMapping) -> torch.Tensor:
        logits = self.model(input_ids=batch["input_ids"], use_cache=False).logits
        nll, mask, _ = token_losses(logits, batch)
        return sequence_means(nll, mask)


def is_causal_lm_config(config: object) -> bool:
    """Whether ``config`` is a transformers ``PretrainedConfig`` (checked only when transformers is loaded)."""
    transformers = sys.modules.get("transformers")
    return transformers is not None and isinstance(config, transformers.PretrainedConfig)


def gpt_proxy_config(vocab_size: int, block_size: int, layers: int, width: int, heads: int) -> GPTConfig:
    """The plugin's GPT at ``layers`` × ``width`` with ``heads`` heads over ``vocab_size`` tokens and a ``block_size``
    context: the proxies beside a learner that is not a transformers model.

    Example::

        gpt_proxy_config(320, 128, 2, 128, 4).n_embd  # 128
    """
    return GPTConfig(vocab_size=vocab_size, block_size=block_size, n_layer=layers, n_head=heads, n_embd=width)


def causal_lm_proxy_config(learner: Any, layers: int, width: int, heads: int) -> Any:
    """The learner's transformers config at ``layers`` × ``width`` with ``heads`` attention heads.

    Vocabulary, context and every other field stay the learner's; the MLP's inner size keeps its ratio
    to the width (``intermediate_size`` or GPT-2's ``n_inner``, when set), grouped-query attention keeps
    its heads-per-group ratio (``num_key_value_heads`` divides ``heads``), a ``head_dim`` field follows the
    proxy's width, ``width // heads`` (a class that stores one, as Qwen3's and Gemma 2's, would otherwise
    fall back to its default, 128 or 256, whatever the width; a class without one derives the same from the
    width), and ``layer_types``, derived from the layer count, is derived again. GPT-2-style names
    (``n_layer``, ``n_embd``, ``n_head``) are reached through the config's ``attribute_map``.

    Args:
        learner: the learner's ``PretrainedConfig`` (not modified).
        layers, width, heads: the proxy's hidden layers, hidden size and attention heads.

    Returns:
        a new config of the learner's class.

    Raises:
        ValueError: ``width`` is not a multiple of ``heads``.

    Example::

        causal_lm_proxy_config(LlamaConfig(hidden_size=512, num_hidden_layers=8), 2, 128, 4).hidden_size  # 128
        causal_lm_proxy_config(Qwen3Config(hidden_size=512, head_dim=64), 2, 128, 4).head_dim  # 32
    """
    if width % heads:
        raise ValueError(f"proxy_width={width} must be a multiple of proxy_heads={heads}")
    fields, names = learner.to_dict(), learner.attribute_map
    for key in ("intermediate_size", "n_inner"):
        if fields.get(key) is not None:
            fields[key] = max(1, round(fields[key] * width / learner.hidden_size))
    if fields.get("num_key_value_heads") is not None:
        kv_heads = max(1, heads * fields["num_key_value_heads"] // learner.num_attention_heads)
        fields["num_key_value_heads"] = math.gcd(kv_heads, heads)
    if "head_dim" in fields:
        fields["head_dim"] = width // heads
    fields.pop("layer_types", None)
    sizes = {"num_hidden_layers": layers, "hidden_size": width, "num_attention_heads": heads}
    fields.update({names.get(key, key): value for key, value in sizes.items()})
    return type(learner).from_dict(fields)


def initialised_proxy(config: Any, torch_seed: int) -> nn.Module:
    """A proxy initialised under ``torch.manual_seed(torch_seed)``; the global torch RNG is left untouched.

    ``config``: a :class:`GPTConfig` (a :class:`ProxyLM`) or a transformers config (a :class:`CausalLMProxy`).

    Example::

        initialised_proxy(gpt_proxy_config(padded_vocab(257), 128, 2, 64, 4), torch_seed=0).model  # the GPT
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(torch_seed)
        return ProxyLM(config) if isinstance(config, GPTConfig) else CausalLMProxy(config)


def seeded_proxy(config: Any, seed: int, purpose: str) -> nn.Module:
    """A proxy whose initial weights depend only on (seed, purpose), not on the global RNG: :func:`initialised_proxy`
    under the seed derived from them.

    ``config``: a :class:`GPTConfig` (a :class:`ProxyLM`) or a transformers config (a :class:`CausalLMProxy`).
    """
    return initialised_proxy(config, derived_seed(seed, 0, 0, purpose))


def reference_vocab(module: nn.Module) -> int | None:
    """The vocabulary size a reference declares: ``module.vocab_size``, else ``module.config.vocab_size`` (or None)."""
    for value in (getattr(module, "vocab_size", None), getattr(getattr(module, "config", None), "vocab_size", None)):
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def reference_context(module: nn.Module) -> tuple[str, int] | None:
    """The longest row a reference's config takes, with the field that says so (``block_size`` of a GPT,
    ``max_position_embeddings`` of a transformers config); None when it declares neither."""
    config = getattr(module, "config", None)
    if isinstance(config, GPTConfig):
        return "block_size", config.block_size
    value = getattr(config, "max_position_embeddings", None) if is_causal_lm_config(config) else None
    return None if value is None else ("max_position_embeddings", int(value))


def check_reference_fits(module: nn.Module, what: str, learner_vocab: int | None = None, data_vocab: int | None = None,
                         seq_len: int | None = None, must_declare: bool = False) -> None:
    """A clear error when a reference cannot score the learner's rows.

    A reference scores the learner's token ids, so its vocabulary (:func:`reference_vocab`) must equal the
    learner's, and hold every id of the data; its context (:func:`reference_context`) must hold ``seq_len``.

    Args:
        module: the reference's scoring module.
        what: how errors name it (e.g. ``"reference 'ref.ckpt'"``).
        learner_vocab: the learner's vocabulary size (None: unknown, not compared).
        data_vocab: the number of token ids the data uses (None: unknown).
        seq_len: the rows' length T (None: unknown).
        must_declare: refuse a reference that declares no vocabulary while one of the sizes is known
            (a given reference; one built by the method is compared only when it declares one).

    Raises:
        ValueError: a vocabulary other than the learner's, smaller than the data's, or undeclared
            (``must_declare``), naming both sizes; a context shorter than ``seq_len``.
    """
    vocab, known = reference_vocab(module), learner_vocab if learner_vocab is not None else data_vocab
    if vocab is None and known is not None and must_declare:
        raise ValueError(f"{what} declares no vocabulary, so it cannot be checked against the learner's {known} "
                         "token ids: give it a vocab_size attribute (or a config with vocab_size)")
    if vocab is not None and learner_vocab is not None and vocab != learner_vocab:
        raise ValueError(f"{what} has vocab_size={vocab} and the learner has vocab_size={learner_vocab}: a reference "
                         "scores the learner's token ids, so it needs the learner's tokenizer and vocabulary; pass a "
                         "reference trained with them")
    if vocab is not None and data_vocab is not None and vocab < data_vocab:
        raise ValueError(f"{what} has vocab_size={vocab}, the data has {data_vocab} token ids")
    context = reference_context(module)
    if context is not None and seq_len is not None and context[1] < seq_len:
        raise ValueError(f"{what} has {context[0]}={context[1]}, shorter than data.seq_len={seq_len}")


class Proxy:
    """A proxy module with its optimizer (AdamW at a constant ``lr``) and step counter; ``lr=None``: frozen.

    Args:
        name: the model's name in the cost metrics and errors.
        module: any ``nn.Module`` with ``per_sample_loss(batch) -> [N]``, on the learner's device.
        meter: where passes and tokens are counted.
        lr: AdamW learning rate (betas 0.9/0.95, no weight decay); None for a frozen model.
        grad_scaling: scale the loss for fp16 autocast (the learner's ``16-mixed``).
        persist: whether :meth:`state_dict` carries the weights (False for a model re-read from a file).
    """

    def __init__(
        self, name: str, module: nn.Module, meter: CostMeter, lr: float | None = None, grad_scaling: bool = False,
        persist: bool = True,
    ) -> None:
        self.name, self.module, self.meter, self.lr, self.persist = name, module, meter, lr, persist
        device = next(module.parameters()).device
        self.optimizer = None if lr is None else torch.optim.AdamW(
            module.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0
        )
        self.scaler = torch.amp.GradScaler(device.type, enabled=grad_scaling and lr is not None)
        self.steps = 0
        if lr is None:
            module.requires_grad_(False)

    @property
    def frozen(self) -> bool:
        return self.optimizer is None

    def freeze(self) -> None:
        """Drop the optimizer: from now on the module only scores."""
        self.optimizer, self.lr = None, None
        self.module.requires_grad_(False)

    def losses(self, batch: MutableMapping) -> torch.Tensor:
        """[N] per-sample losses under the current weights (eval mode, no grad); all non-finite is an error."""
        self.module.eval()
        with torch.no_grad():
            out = per_sample_loss(self.module, batch)
        self.meter.add(self.name, "fwd", batch["input_ids"].numel())
        if not torch.isfinite(out).any():
            raise FloatingPointError(
                f"the {self.name} proxy's loss is non-finite on every candidate after {self.steps} step(s): "
                f"its weights diverged (lr={self.lr}); lower the proxy learning rate"
            )
        return out

    def train_step(self, batch: MutableMapping, phase: str = "") -> float:
        """One optimizer step on the mean per-sample loss of ``batch``; returns that loss (before the step).

        Its passes count under ``<name><phase>`` (``"_pretrain"``: a one-off cost, apart from the per-step ones).
        """
        if self.optimizer is None:
            raise RuntimeError(f"the {self.name} proxy is frozen")
        self.module.train()
        with torch.enable_grad():
            loss = per_sample_loss(self.module, batch).mean()
            if not torch.isfinite(loss):
                raise FloatingPointError(
                    f"the {self.name} proxy's training loss is {float(loss)} at its step {self.steps}: "
                    f"its weights diverged (lr={self.lr}); lower the proxy learning rate"
                )
            self.optimizer.zero_grad(set_to_none=True)
            self.scaler.scale(loss).backward()
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.steps += 1
        tokens = batch["input_ids"].numel()
        self.meter.add(self.name + phase, "fwd", tokens)
        self.meter.add(self.name + phase, "bwd", tokens)
        return float(loss.detach())

    def state_dict(self) -> dict[str, Any]:
        return {
            "module": self.module.state_dict() if self.persist else None,
            "optimizer": None if self.optimizer is None else self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict(),
            "steps": self.steps,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["module"] is not None:
            self.module.load_state_dict(state["module"])
        if state["optimizer"] is None:
            self.freeze()
        elif self.optimizer is None:
            raise ValueError(f"the checkpoint holds optimizer state for the {self.name} proxy, which is frozen here")
        else:
            self.optimizer.load_state_dict(state["optimizer"])
        if state["scaler"]:
            self.scaler.load_state_dict(state["scaler"])
        self.steps = int(state["steps"])


def padded_vocab(vocab_size: int) -> int:
    """The vocabulary rounded up to a multiple of 64 (embedding rows)."""
    return 64 * math.ceil(vocab_size / 64)


def pretrain_on_target(proxy: Proxy, datamodule: object, steps: int, batch_size: int, seed: int) -> None:
    """Train ``proxy`` until it has taken ``steps`` steps on fresh target batches, then freeze it.

    Batch ``s`` is ``datamodule.target_batch(batch_size, rng)`` with ``rng`` derived from
    (seed, s): the same reference on every rank and every rerun. Reads the target split only.
    """
    if not hasattr(datamodule, "target_batch"):
        raise ValueError(
            f"pretraining the {proxy.name} needs a datamodule with target_batch(n, rng) (PoolDataModule reads "
            "--data.target); or pass a reference checkpoint"
        )
    device = next(proxy.module.parameters()).device
    while proxy.steps < steps:
        rng = np.random.default_rng(derived_seed(seed, 0, proxy.steps, "reference-pretrain"))
        rows = datamodule.target_batch(batch_size, rng)
        proxy.train_step({k: v.to(device) for k, v in rows.items()}, phase="_pretrain")
    proxy.freeze()
