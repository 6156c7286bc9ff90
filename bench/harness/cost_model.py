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
"""

from __future__ import annotations

from typing import Any

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
