"""What each selection method needs from the model, the batch and the data: one check per need.

Each check returns the problems it finds, each naming the fix; a method's ``requirements()``
joins the checks it needs and :meth:`SelectionCallback.on_fit_start` raises them all in one
error before the first step. The needs:

- ``per_sample_loss``: the LightningModule has ``per_sample_loss(batch) -> Tensor[N]``, the mean
  token loss of each row (high-loss, RHO-LOSS, ClassAct's paper variant, OPUS, GREATS).
- ``target_batch``: the datamodule has ``target_batch(n, rng) -> dict`` of n target-split rows
  (``input_ids``, and ``labels`` when training batches carry them): the proxy batches of OPUS and
  GREATS without ``proxy=FILE``, the reference pretraining of RHO-LOSS and ClassAct without a
  reference checkpoint.
- ``proxy builder``: RHO-LOSS and ClassAct build proxies like the learner: from the module's
  ``config`` (a Hugging Face ``PretrainedConfig``: the same architecture; a ``GPTConfig``: the
  plugin's GPT), from the datamodule's ``vocab_size``/``seq_len`` (the plugin's GPT), or from an
  overridden ``build_proxy()`` returning any ``nn.Module`` with ``per_sample_loss``.
- ``domain names``: the oracle maps ``domain`` codes to names through ``datamodule.domain_names``.
"""

from __future__ import annotations

from typing import Any

from selection_callbacks.nn.gpt import GPTConfig
from selection_callbacks.scoring.losses import PerSampleLoss
from selection_callbacks.scoring.proxy_models import is_causal_lm_config

__all__ = ["needs_domain_names", "needs_per_sample_loss", "needs_proxy_builder", "needs_target_batch"]


def needs_per_sample_loss(pl_module: Any, who: str) -> list[str]:
    if isinstance(pl_module, PerSampleLoss):
        return []
    return [f"{who} scores with the learner's per-sample loss, and {type(pl_module).__name__} has no "
            "per_sample_loss(batch) -> Tensor[N]: add it (mean token loss of each row; docs/own-model-and-data.md shows one)"]


def needs_target_batch(datamodule: Any, who: str, why: str, instead: str) -> list[str]:
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


def _datamodule(datamodule: Any) -> str:
    return "the fit, run without a datamodule," if datamodule is None else f"the datamodule ({type(datamodule).__name__})"
