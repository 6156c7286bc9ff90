"""A run's modelled step cost over a plain training step's, from the passes its selector counted.

A training step is a forward and a backward over the K·T tokens the learner trains on: 3 units of
F_learner FLOPs per token (a backward costs two forwards: gradients of activations and of weights).
A selector's extra passes are weighed the same way, each by its own model's F (``flops_per_token``
in the selector's summary, :func:`selection_callbacks.nn.flops.matmul_flops_per_token`):

    modelled ratio = 1 + Σ_passes tokens · (1 forward, 2 backward) · F_model / (3 · F_learner · update tokens)

A ghost scoring backward counts as 2: its gradients of activations, then per layer the utilities
Σ_t b_tᵀ Q a_t (one weight-gradient-sized product per row). It runs only from the loss down to the
earliest scored layer, so it is counted under ``learner_reached``, whose F covers the layers it
reaches (all of them unless only late layers are scored). Passes under ``<model>_pretrain``
(a reference trained before the first step) are one-off and reported apart. Left out, so they
show as the gap between a measured and a modelled ratio: the maps (Muon's Newton–Schulz products),
sketches, host syncs, kernel launches and Python.

The FLOP weight assumes every model runs a FLOP at the learner's rate; on a CPU a narrower model runs slower
per FLOP. :mod:`bench.harness.pass_timing` weighs the same counted passes by their seconds on the host instead.

:func:`projected_cost` carries a run's modelled parts to another shape (a larger learner, a longer
context) under stated assumptions; see its docstring.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from selection_callbacks.nn.flops import matmul_flops_per_token
from selection_callbacks.nn.gpt import GPT, GPTConfig
from selection_callbacks.scoring.proxy_models import gpt_proxy_config

PASS_UNITS = {"fwd": 1, "bwd": 2}


def modelled_cost(metrics: dict[str, Any]) -> dict[str, Any]:
    """``{"ratio", "parts", "one_off"}`` of a run's metrics.json: the modelled step ratio to a plain step, each
    counted pass kind's share of it (``"reference_fwd": 0.21``, ...) and the one-off passes in plain-step units."""
    selection = metrics.get("selection") or {}
    cost, flops = selection.get("cost") or {}, selection.get("flops_per_token") or {}
    if not cost:
        return {"ratio": 1.0, "parts": {}, "one_off": 0.0}
    missing = {key.rsplit("_", 1)[0].removesuffix("_pretrain") for key in cost} - set(flops)
    if missing or not flops.get("learner") or not metrics.get("update_tokens"):
        raise ValueError(f"the run's summary counts passes of {sorted(missing) or 'its models'} without their "
                         "flops_per_token or update tokens: rerun it with this version")
    plain_step = 3 * flops["learner"] * metrics["update_tokens"] / max(1, metrics["global_step"])
    steps = max(1, metrics["global_step"])
    parts, one_off = {}, 0.0
    for key, counted in sorted(cost.items()):
        model, kind = key.rsplit("_", 1)
        units = counted["tokens"] * PASS_UNITS[kind] * flops[model.removesuffix("_pretrain")] / plain_step
        if model.endswith("_pretrain"):
            one_off += units
        else:
            parts[key] = units / steps
    return {"ratio": 1.0 + sum(parts.values()), "parts": parts, "one_off": one_off}


@dataclass(frozen=True)
class Shape:
    """What the projection reads of a run: the learner's architecture, the training sequence length T and the
    proxies' architecture (None for a method without proxies; their vocabulary and context follow the learner's,
    as the selectors build them)."""

    learner: GPTConfig
    seq_len: int
    proxy: GPTConfig | None = None


def proxy_config(learner: GPTConfig, settings: dict[str, Any]) -> GPTConfig | None:
    """The proxies a proxy method builds beside a GPT ``learner``: ``proxy_layers`` × ``proxy_width`` with
    ``proxy_heads`` heads and the learner's vocabulary and context
    (:func:`selection_callbacks.scoring.proxy_models.gpt_proxy_config`, the rule
    :meth:`selection_callbacks.methods.bases.proxy.ProxySelection.proxy_config` applies to a GPT); None for a method
    whose ``settings`` (its selection arguments) name no proxies."""
    if "proxy_layers" not in settings:
        return None
    return gpt_proxy_config(learner.vocab_size, learner.block_size, settings["proxy_layers"], settings["proxy_width"],
                            settings["proxy_heads"])


def attention_flops_per_token(config: GPTConfig, context: int) -> int:
    """2 · n_layer · context · n_embd: the score (q·kᵀ) and value (a·v) products of one forward token, each
    2·n_embd FLOPs per key, over the context/2 keys a causal position sees on average (a kernel that skips
    masked blocks; one that computes the whole square costs twice this)."""
    return 2 * config.n_layer * context * config.n_embd


def flops_per_token(config: GPTConfig, context: int, attention: bool) -> int:
    """One forward token's FLOPs: the linear layers' (:func:`matmul_flops_per_token`, what runs count) plus,
    with ``attention``, the context-dependent score products. The model is built on the meta device (no weights)."""
    with torch.device("meta"):
        model = GPT(config)
    return matmul_flops_per_token(model) + (attention_flops_per_token(config, context) if attention else 0)


def projected_cost(parts: dict[str, float], window: int | None, source: Shape, target: Shape,
                   attention: bool = True) -> dict[str, Any]:
    """``{"ratio", "parts"}``: the modelled step ratio of a method at ``target``, from its modelled parts at
    ``source`` (:func:`modelled_cost`'s ``parts``, or a steptime.json's ``modelled_parts``).

    A part is p = τ · u · F_m / (3 F_L): τ the pass's tokens per update token, u its units (forward 1,
    backward 2), F_m its model's FLOPs per token, F_L the learner's. At the target

        p' = p · (τ'/τ) · (F_m' / F_m) / (F_L' / F_L)

    - τ'/τ: a pass runs over rows proportional to the batch, each of ``window`` tokens (a scoring window,
      kept at its length) or of the whole sequence (None), while update tokens grow with T: so τ'/τ = T/T'
      for a windowed pass and 1 for a whole-sequence one. Rows fixed in number (OPUS's target batch) are
      read as proportional too, which is exact when source and target have the same batch.
    - F: passes of ``learner*`` models (``learner``, ``learner_reached``) run the learner, the others a proxy;
      the source's F are matmul FLOPs (what runs count), the target's add attention over each pass's context
      (the window, or T') when ``attention``. A part's own share of the learner (the layers a ghost
      backward reaches) is kept.

    The ratio assumes every pass runs at the training step's FLOP efficiency. With ``attention=False`` and
    ``target == source`` it returns ``parts`` unchanged.

    Args:
        parts: ``{"<model>_<fwd|bwd>": share of a plain step}`` at ``source``.
        window: the method's scoring window in tokens (``score_len``); None: its passes read whole sequences.
        source: the shape the parts were counted at.
        target: the shape to project to (its proxies at the method's own layers × width).
        attention: add the context-dependent attention FLOPs at the target (False: matmul FLOPs only).

    Raises:
        ValueError: a part runs a proxy and a shape has none.

    Example:
        >>> tiny = Shape(GPTConfig(n_layer=4, n_head=4, n_embd=128), 128)
        >>> projected_cost({"learner_fwd": 0.25}, 16, tiny, tiny, attention=False)["ratio"]
        1.25
    """
    learner = flops_per_token(target.learner, target.seq_len, attention) / flops_per_token(source.learner, 0, False)
    out = {}
    for key, part in parts.items():
        runs_learner = key.rsplit("_", 1)[0].startswith("learner")
        before, after = (source.learner, target.learner) if runs_learner else (source.proxy, target.proxy)
        if before is None or after is None:
            raise ValueError(f"{key} runs a proxy: give both shapes its architecture")
        length, was = (target.seq_len, source.seq_len) if window is None else (
            min(window, target.seq_len), min(window, source.seq_len))
        tokens = length / was * source.seq_len / target.seq_len  # τ'/τ
        model = flops_per_token(after, length, attention) / flops_per_token(before, 0, False)
        out[key] = part * tokens * model / learner
    return {"ratio": 1.0 + sum(out.values()), "parts": out}
