"""What each selection method needs from the model, the batch and the data: one check per need.

Each check returns the problems it finds, each naming the fix; a method's ``requirements()``
joins the checks it needs and :meth:`SelectionCallback.on_fit_start` raises them all in one
error before the first step. The needs:

- ``per_sample_loss``: the LightningModule has ``per_sample_loss(batch) -> Tensor[N]``, the mean
  token loss of each row (high-loss, RHO-LOSS, ClassAct's paper variant, OPUS, GREATS).
- ``target_batch``: the datamodule has ``target_batch(n, rng) -> dict`` of n target-split rows
  (``input_ids``, and ``labels`` when training batches carry them): the target batches of OPUS and
  GREATS without ``target_file=FILE``, the reference pretraining of RHO-LOSS and ClassAct without a
  reference checkpoint.
- ``proxy builder``: RHO-LOSS and ClassAct build proxies like the learner: from the module's
  ``config`` (a Hugging Face ``PretrainedConfig``: the same architecture; a ``GPTConfig``: the
  plugin's GPT), from the datamodule's ``vocab_size``/``seq_len`` (the plugin's GPT), or from an
  overridden ``build_proxy()`` returning any ``nn.Module`` with ``per_sample_loss``.
- ``domain names``: the oracle maps ``domain`` codes to names through ``datamodule.domain_names``,
  and prefers ``target_domains`` or the target split's (``datamodule.splits["target"].domain_names``).

A method states that it reads target rows by calling :func:`needs_target_batch` in its
``requirements()``; :func:`target_batch_readers` collects those calls, so the base class draws and
checks one target batch before the first step for exactly those methods.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from selection_callbacks.nn.gpt import GPTConfig
from selection_callbacks.scoring.losses import PerSampleLoss
from selection_callbacks.scoring.proxy_models import is_causal_lm_config

__all__ = [
    "TargetUse", "needs_domain_names", "needs_per_sample_loss", "needs_proxy_builder", "needs_target_batch",
    "needs_target_domains", "target_batch_readers", "target_domain_names", "wrapped_causal_lm",
]


@dataclass(frozen=True)
class TargetUse:
    """A method that reads target rows: its name, what it reads them for, and what it takes instead."""

    who: str
    why: str
    instead: str


_READERS: ContextVar[list[TargetUse] | None] = ContextVar("target_batch_readers", default=None)


@contextmanager
def target_batch_readers() -> Iterator[list[TargetUse]]:
    """The :class:`TargetUse` of every :func:`needs_target_batch` call made while the block runs."""
    readers: list[TargetUse] = []
    token = _READERS.set(readers)
    try:
        yield readers
    finally:
        _READERS.reset(token)


def needs_per_sample_loss(pl_module: Any, who: str) -> list[str]:
    if isinstance(pl_module, PerSampleLoss):
        return []
    return [f"{who} scores with the learner's per-sample loss, and {type(pl_module).__name__} has no "
            "per_sample_loss(batch) -> Tensor[N]: add it (mean token loss of each row; docs/own-model-and-data.md shows one)"]


def needs_target_batch(datamodule: Any, who: str, why: str, instead: str) -> list[str]:
    readers = _READERS.get()
    if readers is not None:
        readers.append(TargetUse(who, why, instead))
    if hasattr(datamodule, "target_batch"):
        return []
    return [f"{who} {why} and {_datamodule(datamodule)} has no target_batch(n, rng) -> dict: "
            f"add it (n rows of the target split; PoolDataModule reads --data.target) or {instead}"]


def needs_proxy_builder(builder_overridden: bool, pl_module: Any, datamodule: Any, who: str) -> list[str]:
    config = getattr(pl_module, "config", None)
    if builder_overridden or isinstance(config, GPTConfig) or is_causal_lm_config(config):
        return []
    if hasattr(datamodule, "vocab_size") and hasattr(datamodule, "seq_len"):
        return []
    return [f"{who} builds its proxies from the learner's `config` (a Hugging Face PretrainedConfig or a GPTConfig) "
            f"or the datamodule's vocab_size and seq_len, and {type(pl_module).__name__} has neither config while "
            f"{_datamodule(datamodule)} has no vocab_size/seq_len: give the learner such a config, give the "
            "datamodule vocab_size and seq_len, or override build_proxy(trainer, pl_module, purpose) to return an "
            "nn.Module with per_sample_loss(batch)"]


def needs_domain_names(datamodule: Any, who: str) -> list[str]:
    if getattr(datamodule, "domain_names", None) is not None:
        return []
    return [f"{who} maps the batch's 'domain' codes to names and {_datamodule(datamodule)} has no domain_names: "
            "add a domain_names list (code → name), as PoolDataModule has"]


def target_domain_names(datamodule: Any) -> list[str] | None:
    """The target split's domain names, ``datamodule.splits["target"].domain_names`` (PoolDataModule's); None without."""
    splits = getattr(datamodule, "splits", None)
    target = splits.get("target") if isinstance(splits, dict) else None
    names = getattr(target, "domain_names", None)
    return list(names) if names is not None else None


def needs_target_domains(datamodule: Any, target_domains: list[str] | None, who: str) -> list[str]:
    """The oracle's preferred domains exist: given ones among ``domain_names``, or the target split's, some of them."""
    names = list(getattr(datamodule, "domain_names", None) or [])
    if target_domains is not None:
        unknown = [name for name in target_domains if name not in names]
        if unknown:
            return [f"{who}'s target_domains {unknown} are not among the domain_names {names} of "
                    f"{_datamodule(datamodule)}: name domains the training batches carry"]
        return []
    wanted = target_domain_names(datamodule)
    if wanted is None:
        return [f"{who} prefers the target split's domains, read from datamodule.splits['target'].domain_names, and "
                f"{_datamodule(datamodule)} has no such split: pass target_domains=[...] (names from its domain_names "
                f"{names})"]
    if not set(wanted) & set(names):
        return [f"none of the target split's domains {wanted} is among the domain_names {names} of "
                f"{_datamodule(datamodule)}, so {who} would rank every candidate alike: pass target_domains=[...] "
                f"from {names}"]
    return []


def wrapped_causal_lm(pl_module: Any, who: str) -> str | None:
    """A warning when ``pl_module`` holds a Hugging Face causal LM yet exposes no ``config`` of its own (None otherwise):
    proxies are built like the learner only from the module's ``config``, else as the plugin's GPT."""
    own = getattr(pl_module, "config", None)
    if is_causal_lm_config(own) or isinstance(own, GPTConfig) or not hasattr(pl_module, "named_modules"):
        return None
    lacks = "has no `config` of its own" if own is None else f"its own `config` is a {type(own).__name__}, not that model's"
    for name, module in pl_module.named_modules():
        config = getattr(module, "config", None)
        if name and is_causal_lm_config(config):
            return (f"{who} builds its proxies as the plugin's GPT: {type(pl_module).__name__} holds a Hugging Face "
                    f"{type(module).__name__} at '{name}' but {lacks}; set `self.config = self.{name}.config` in its "
                    f"__init__ to build them as {type(config).__name__}'s architecture")
    return None


def _datamodule(datamodule: Any) -> str:
    return "the fit, run without a datamodule," if datamodule is None else f"the datamodule ({type(datamodule).__name__})"
