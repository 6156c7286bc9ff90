"""Brute force for the ghost engine on Hugging Face causal LMs: explicit per-sample gradients from ``torch.func``
and the utilities and squared norms the engine must reproduce from them."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.func import functional_call, grad, vmap


def per_sample_grads(model: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """name → [R, *shape] per-row gradients of the row's mean token loss over ``labels`` (a tied tensor once,
    under its first name), for a transformers causal LM ``model``."""
    params = {k: v.detach() for k, v in model.named_parameters()}

    def single(p, x, y):
        logits = functional_call(model, p, (), {"input_ids": x[None], "use_cache": False}).logits
        return F.cross_entropy(logits[0], y)

    return vmap(grad(single), in_dims=(None, 0, 0))(params, batch["input_ids"], batch["labels"])


def brute_force(
    model: nn.Module, G: dict[str, torch.Tensor], resolver: Callable, layers: list[tuple[str, nn.Module]], n_cand: int
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Per scored weight (a tied one once, under its first layer): u_i = Σ_params ⟨G_i, −Jᵀḡ⟩ over the layer's
    weight and bias, from the per-sample gradients ``G`` of ``n_cand`` candidate rows then the target rows (ḡ their
    mean); and Σ ‖P G_i‖² over every scored parameter. ``resolver``: the step maps, ``resolver([p], ḡ)`` → P."""
    names = {id(p): n for n, p in model.named_parameters()}
    utilities, sq, seen = {}, torch.zeros(n_cand), set()
    for layer, module in layers:
        if id(module.weight) in seen:
            continue
        seen.add(id(module.weight))
        utilities[layer] = torch.zeros(n_cand)
        for p in (module.weight, getattr(module, "bias", None)):
            if p is None:
                continue
            g = G[names[id(p)]]
            gbar = g[n_cand:].mean(0)[None]
            P = resolver([p], gbar)
            utilities[layer] += (g[:n_cand] * P.utility_vector(gbar)[0]).flatten(1).sum(1)
            sq += P.apply(g[None, :n_cand])[0].flatten(1).pow(2).sum(1)
    return utilities, sq


def assert_utilities_match(got, want: dict[str, torch.Tensor]) -> None:
    """The engine's scores ``got`` (a GhostScores) equal the brute force's per-layer utilities ``want``, layer by
    layer and in total. A row's total may cancel to near zero across layers, so the total's tolerance is the sum of
    the layers' (each 1e-5 of its largest magnitude), never a share of the total itself."""
    assert list(got.layer_utilities) == list(want)
    for layer, u in want.items():
        torch.testing.assert_close(got.layer_utilities[layer], u, rtol=1e-4, atol=1e-5 * float(u.abs().max()), msg=layer)
    total = sum(want.values())
    budget = sum(1e-5 * float(u.abs().max()) for u in want.values())
    torch.testing.assert_close(got.utilities, total, rtol=1e-4, atol=budget)
    assert float(total.abs().min()) > budget  # no row's total is lost in the tolerance
