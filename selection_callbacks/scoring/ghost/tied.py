"""Ghost scores of one weight tied across several layers (a head tied to the token embedding).

The weight is one parameter: its per-sample gradient is the sum over its uses, G_i = Σ_k G_i^(k), so ḡ sums
the uses' target gradients, P and Q = −Jᵀḡ are fixed once and u_i = Σ_k ⟨G_i^(k), Q⟩ is exact. The uses'
sketches go through one sketcher (a linear sketch of the sum); ‖P G_i‖² is taken over the formed sum.
It is scored once, under its first layer's name.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn as nn

from selection_callbacks.scoring.ghost.embedding import elementwise, embedding_mats, embedding_rows, embedding_sketch
from selection_callbacks.scoring.ghost.linear import (
    choose_sketch_path,
    factors,
    formed_pg,
    linear_utilities,
    sketch_linear,
)
from selection_callbacks.scoring.ghost.scorers import TiedWeight, register_scorer
from selection_callbacks.scoring.ghost.state import FixedMaps, PassState

if TYPE_CHECKING:
    from selection_callbacks.scoring.ghost.engine import GhostEngine

Use = tuple[str, torch.Tensor, torch.Tensor]  # ("embedding", ids [R, T], B [R, T, d]) or ("linear", B [1, R, T, rows], A [1, R, T, cols])


@register_scorer(TiedWeight)
def score_tied(engine: GhostEngine, names: tuple[str, ...], state: PassState) -> None:
    """The scores of the weight the layers ``names`` share, under ``names[0]``."""
    first, N = names[0], state.n
    weight = engine.parameter(first)
    uses = _uses(engine, names, state)
    fixed = state.fixed.get((first,))
    if fixed is None:
        fixed = state.fixed[(first,)] = _tied_maps(engine, first, weight, uses, state)
    if N == 0:
        return
    P, u, mats = fixed.map, 0.0, []
    for kind, left, right in uses:
        if kind == "embedding":
            ids, B = left[:N], right[:N]
            u = u + (fixed.Q[0][ids] * B).sum((1, 2))
            rows = embedding_rows(P, ids, B)
            if engine.sketch_dim:
                state.add_sketch(embedding_sketch(engine, first, ids, rows, weight.shape[0], state))
            mats.append(embedding_mats(engine, ids, rows, weight.shape[0]))
        else:
            B, A = left[:, :N], right[:, :N]
            u = u + linear_utilities(B, A, fixed.Q)[0]
            if engine.sketch_dim:
                state.add_sketch(sketch_linear(engine, (first,), fixed, B, A, state))
            mats.append(G[0] for G in formed_pg(engine, P, B, A))
    state.utilities[first] = u
    if engine.norms:
        state.add_norm(torch.cat([sum(chunks).pow(2).sum((1, 2)) for chunks in zip(*mats)]))


def _uses(engine: GhostEngine, names: tuple[str, ...], state: PassState) -> list[Use]:
    """Each use's captures, popped from ``state``, in the weight's stored orientation."""
    uses = []
    for name in names:
        x, g = state.inputs.pop(name), state.grads.pop(name)
        if isinstance(engine.module(name), nn.Embedding):
            uses.append(("embedding", x.reshape(g.shape[0], -1), g.reshape(g.shape[0], -1, g.shape[-1]).float()))
        else:
            uses.append(("linear", *factors(engine.module(name), x[None], g[None])[:2]))
    return uses


def _tied_maps(engine: GhostEngine, first: str, weight: torch.Tensor, uses: list[Use], state: PassState) -> FixedMaps:
    """P and Q of the tied weight from the sum of its uses' target gradients."""
    N = state.n
    gbar = torch.zeros(weight.shape, device=uses[0][2].device)
    for kind, left, right in uses:
        if kind == "embedding":
            gbar.index_add_(0, left[N:].reshape(-1), right[N:].reshape(-1, right.shape[-1]))
        else:
            gbar += left[0, N:].flatten(0, 1).mT @ right[0, N:].flatten(0, 1)
    gbar = gbar.div_(state.target_rows())[None]
    P = state.step_maps([weight], gbar)
    if any(kind == "embedding" for kind, *_ in uses):
        P = elementwise(first, P)
    fixed = FixedMaps(P, P.utility_vector(gbar))
    choose_sketch_path(engine, fixed, state.factor_errors)
    return fixed
