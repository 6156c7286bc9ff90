"""Ghost scores of embedding tables (``nn.Embedding``), one table at a time.

A row's gradient of a table looked up with ids x_t is G_i = Σ_t e_{x_t} b_tᵀ (b_t the gradient at the
looked-up vector), so for an elementwise map P (SGD's, AdamW's) P G_i = Σ_t e_{x_t} b'_tᵀ with b'_t the
map's diagonal at row x_t times b_t: utilities, sketches and norms never form a [V, d] matrix per candidate
but for norms and probes.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
import torch.nn as nn

from selection_callbacks.scoring.ghost.scorers import register_scorer
from selection_callbacks.scoring.ghost.state import FixedMaps, PassState
from selection_callbacks.scoring.maps.adamw import DiagonalMap
from selection_callbacks.scoring.maps.base import OptimizerMap
from selection_callbacks.scoring.maps.sgd import ScalarMap
from selection_callbacks.scoring.sketch import CountSketch, TensorSketch

if TYPE_CHECKING:
    from selection_callbacks.scoring.ghost.engine import GhostEngine


@register_scorer(nn.Embedding)
def score_embedding(engine: GhostEngine, names: tuple[str, ...], state: PassState) -> None:
    """The scores of one table (``names`` holds one name: embeddings are not grouped)."""
    (name,) = names
    module = engine.module(name)
    x, g = state.inputs.pop(name), state.grads.pop(name)
    R = g.shape[0]
    ids, B = x.reshape(R, -1), g.reshape(R, -1, g.shape[-1]).float()
    N, V, d = state.n, module.num_embeddings, B.shape[-1]
    fixed = state.fixed.get((name,))
    if fixed is None:
        gbar = torch.zeros(V, d, device=B.device).index_add_(0, ids[N:].reshape(-1), B[N:].reshape(-1, d))
        gbar /= state.target_rows()
        P = elementwise(name, state.step_maps([engine.parameter(name)], gbar[None]))
        fixed = state.fixed[(name,)] = FixedMaps(P, P.utility_vector(gbar[None])[0])
    if N == 0:
        return
    ids, B, P = ids[:N], B[:N], fixed.map
    state.utilities[name] = (fixed.Q[ids] * B).sum((1, 2))
    rows = embedding_rows(P, ids, B)
    if engine.sketch_dim:
        state.add_sketch(embedding_sketch(engine, name, ids, rows, V, state))
        if state.probe:
            state.add_probe(torch.cat(list(embedding_mats(engine, ids[: state.probe], rows[: state.probe], V)))[None])
    if engine.norms:
        state.add_norm(torch.cat([G.pow(2).sum((1, 2)) for G in embedding_mats(engine, ids, rows, V)]))


def elementwise(name: str, P: OptimizerMap) -> OptimizerMap:
    """``P``, an elementwise map (an embedding's gradient rows stay rows only under one).

    Raises:
        TypeError: another map (Muon's) for embedding ``name``.
    """
    if not isinstance(P, (DiagonalMap, ScalarMap)):
        raise TypeError(f"embedding {name!r} is mapped by {type(P).__name__}; only elementwise maps apply")
    return P


def embedding_rows(P: OptimizerMap, ids: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    """b'_t = P's diagonal at row x_t times b_t, [N, T, d]: P G_i = Σ_t e_{x_t} b'_tᵀ for an elementwise P."""
    return P.C * P.D[0][ids] * B if isinstance(P, DiagonalMap) else P.c * B


def embedding_sketch(engine: GhostEngine, name: str, ids: torch.Tensor, rows: torch.Tensor, vocab: int,
                     state: PassState) -> torch.Tensor:
    """[N, m] the sketch of P G_i = Σ_t e_{x_t} b'_tᵀ under the sketcher of layer ``name``."""
    if engine.sketch == "tensor":
        return engine.sketcher((name,), TensorSketch, vocab, rows.shape[-1], state.seed, rows.device).one_hot(rows, ids)
    if engine.sketch == "count":
        cs = engine.sketcher((name,), CountSketch, vocab, rows.shape[-1], state.seed, rows.device)
        return torch.cat([cs(G[None]) for G in embedding_mats(engine, ids, rows, vocab)])
    raise ValueError("two-sided sketches do not cover embeddings; use sketch='tensor' or 'count'")


def embedding_mats(engine: GhostEngine, ids: torch.Tensor, rows: torch.Tensor, vocab: int) -> Iterator[torch.Tensor]:
    """Per-sample P G_i = Σ_t e_{x_t} b'_tᵀ as [chunk, V, d] matrices."""
    for k in range(0, ids.shape[0], engine.chunk):
        yield torch.stack(
            [torch.zeros(vocab, rows.shape[-1], device=rows.device).index_add_(0, i, r)
             for i, r in zip(ids[k : k + engine.chunk], rows[k : k + engine.chunk])]
        )
