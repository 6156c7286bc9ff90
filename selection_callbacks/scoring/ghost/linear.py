"""Ghost scores of linear layers (``nn.Linear``; transformers' ``Conv1D``, stored transposed), grouped by shape.

For a linear layer y_t = W a_t, sample i's gradient is G_i = Σ_t b_t a_tᵀ with b_t = ∂ℓ_i/∂y_t; a ``Conv1D``
stores W as [in, out] (y_t = Wᵀ a_t) and is scored in its stored orientation, G_i = Σ_t a_t b_tᵀ, so the
optimizer's map of the stored parameter applies as it is. Per group of L layers: the target direction
ḡ = (1/P) Σ_p G_p and Q = −Jᵀḡ, exact utilities u_i = ⟨G_i, Q⟩ = Σ_t b_tᵀ Q a_t, and optional sketches,
probes and squared norms ‖P G_i‖².
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
import torch.nn as nn

from selection_callbacks.scoring.ghost.layers import linear_kind
from selection_callbacks.scoring.ghost.scorers import register_scorer
from selection_callbacks.scoring.ghost.state import FixedMaps, PassState
from selection_callbacks.scoring.maps.adamw import DiagonalMap
from selection_callbacks.scoring.maps.base import OptimizerMap, rows_matmul
from selection_callbacks.scoring.sketch import CountSketch, TensorSketch, TwoSidedProjection

if TYPE_CHECKING:
    from selection_callbacks.scoring.ghost.engine import GhostEngine

FORMED_ELEMENTS = 1 << 19  # numbers of formed P G_i per chunk where a tensor sketch forms them (2 MB: stays in cache)


@register_scorer(nn.Linear)
def score_linear(engine: GhostEngine, names: tuple[str, ...], state: PassState) -> None:
    """The scores of the layer group ``names`` (same shape), in the weight's stored orientation:
    B [L, R, T, rows], A [L, R, T, cols], G = Σ_t b_t a_tᵀ [rows, cols]. A Linear's rows are its
    outputs (B the output gradients, A the inputs); a Conv1D's weight is stored [in, out], so B
    is its inputs and A its output gradients."""
    inputs = [state.inputs.pop(name) for name in names]
    grads = [state.grads.pop(name) for name in names]
    N = state.n
    B, A, out = factors(engine.module(names[0]), stack(inputs), stack(grads))
    del inputs, grads
    fixed = state.fixed.get(names)
    if fixed is None:  # the pass carrying the target rows fixes the group's maps
        fixed = state.fixed[names] = linear_maps(engine, names, B, A, out, state)
    if N == 0:
        return
    B, A, out = B[:, :N], A[:, :N], out[:, :N]
    formed = not fixed.factored  # only a tensor sketch's AdamW groups beyond the tolerance (choose_sketch_path)
    if formed:  # the sketch forms every G_i: the utilities read them instead of a product of their own
        u, sketch = formed_sketch(engine, names, fixed, B, A, state)
    else:
        u = linear_utilities(B, A, fixed.Q)
    bias_pg = None
    if fixed.bias_map is not None:  # G_bias = Σ_t ∂ℓ/∂y_t
        g_bias = out.sum(2)  # [L, N, d_out]
        u = u + (g_bias * fixed.Q_bias[:, None, :]).sum(-1)
        if engine.sketch_dim or engine.norms:
            bias_pg = fixed.bias_map.apply(g_bias)
    state.utilities.update(zip(names, u.unbind(0)))
    if engine.sketch_dim:
        state.add_sketch(sketch if formed else sketch_linear(engine, names, fixed, B, A, state))
        if bias_pg is not None:
            cs = engine.sketcher(tuple(n + ".bias" for n in names), CountSketch, bias_pg.shape[-1], 1, state.seed, B.device)
            state.add_sketch(cs(bias_pg[..., None]))
        if state.probe:
            k = state.probe
            state.add_probe(*formed_pg(engine, fixed.map, B[:, :k], A[:, :k], chunk=k),
                            *(() if bias_pg is None else (bias_pg[:, :k],)))
    if engine.norms:
        sq = sq_norms(engine, fixed.map, B, A).sum(0)
        state.add_norm(sq if bias_pg is None else sq + bias_pg.pow(2).sum((0, 2)))


def stack(tensors: list[torch.Tensor]) -> torch.Tensor:
    """[L, ...]; a single tensor is viewed, not copied."""
    return tensors[0].unsqueeze(0) if len(tensors) == 1 else torch.stack(tensors)


def factors(module: nn.Module, inputs: torch.Tensor, grads: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(B [L, R, T, rows], A [L, R, T, cols], output gradients [L, R, T, d_out]) in float32 from a layer
    group's captures: the weight's stored orientation (views, no copies)."""
    L, R = grads.shape[0], grads.shape[1]
    out = grads.reshape(L, R, -1, grads.shape[-1]).float()
    x = inputs.reshape(L, R, -1, inputs.shape[-1]).float()
    return (x, out, out) if linear_kind(module) == "conv1d" else (out, x, out)


def linear_maps(
    engine: GhostEngine, names: tuple[str, ...], B: torch.Tensor, A: torch.Tensor, out: torch.Tensor, state: PassState
) -> FixedMaps:
    """P and Q = −Jᵀḡ of the grouped linear layers ``names`` from the pass's B [L, n + P, T, rows],
    A [L, n + P, T, cols] and output gradients ``out`` (for biases); the target rows fix ḡ."""
    n = state.n
    # Σ_p Σ_t b aᵀ / P, [L, rows, cols]
    gbar = (B[:, n:].flatten(1, 2).mT @ A[:, n:].flatten(1, 2)).div_(state.target_rows())
    P = state.step_maps([engine.parameter(name) for name in names], gbar)
    fixed = FixedMaps(P, P.utility_vector(gbar))
    if engine.parameter(names[0], "bias") is not None:
        gbar_bias = out[:, n:].sum(2).mean(1)
        fixed.bias_map = state.step_maps([engine.parameter(name, "bias") for name in names], gbar_bias)
        fixed.Q_bias = fixed.bias_map.utility_vector(gbar_bias)
    choose_sketch_path(engine, fixed, state.factor_errors)
    return fixed


def choose_sketch_path(engine: GhostEngine, fixed: FixedMaps, factor_errors: bool) -> None:
    """For an AdamW map sketched by hashing: its ρ (and, if asked, its Frobenius factor error), and whether the
    sketch goes through the rank-1 factors (two-sided always; tensor where ρ ≤ ``factor_tolerance``) or through
    the formed P G_i."""
    P = fixed.map
    if engine.sketch_dim and engine.sketch != "count" and isinstance(P, DiagonalMap):
        fixed.relative_factor_error = P.relative_factor_error
        fixed.factor_error = P.factor_error if factor_errors else None
        fixed.factored = engine.sketch == "two_sided" or (
            engine.factor_tolerance > 0 and float(fixed.relative_factor_error.max()) <= engine.factor_tolerance)


def linear_utilities(B: torch.Tensor, A: torch.Tensor, Q: torch.Tensor) -> torch.Tensor:
    """[L, N] u = Σ_t b_tᵀ Q a_t for B [L, N, T, rows], A [L, N, T, cols], Q [L, rows, cols]; the product lands
    on the narrower side (fewer numbers to multiply and sum)."""
    return (rows_matmul(B, Q).mul_(A) if A.shape[-1] <= B.shape[-1] else rows_matmul(A, Q.mT).mul_(B)).sum((2, 3))


def formed_pg(engine: GhostEngine, P: OptimizerMap, B: torch.Tensor, A: torch.Tensor,
              chunk: int | None = None) -> Iterator[torch.Tensor]:
    """P G_i [L, chunk, d_out, d_in] in candidate chunks (of ``chunk``, default the engine's)."""
    chunk = chunk or engine.chunk
    for i in range(0, B.shape[1], chunk):
        yield P.apply(torch.einsum("lnto,lnti->lnoi", B[:, i : i + chunk], A[:, i : i + chunk]))


def sketch_linear(engine: GhostEngine, names: tuple[str, ...], fixed: FixedMaps, B: torch.Tensor, A: torch.Tensor,
                  state: PassState) -> torch.Tensor:
    """[N, m] the sketch of P G_i of the group, by the engine's sketch kind."""
    d_out, d_in, P = B.shape[-1], A.shape[-1], fixed.map
    if engine.sketch == "count":
        cs = engine.sketcher(names, CountSketch, d_out, d_in, state.seed, B.device)
        return torch.cat([cs(G) for G in formed_pg(engine, P, B, A)])
    if not fixed.factored:
        return formed_sketch(engine, names, fixed, B, A, state, utilities=False)[1]
    cls = TensorSketch if engine.sketch == "tensor" else TwoSidedProjection
    sketcher = engine.sketcher(names, cls, d_out, d_in, state.seed, B.device)
    if hasattr(P, "token_maps"):  # the token factors' maps folded into the sketch's dense rows
        return sketcher(B, A, *P.token_maps())
    return sketcher(*P.token_factors(B, A))


def formed_sketch(engine: GhostEngine, names: tuple[str, ...], fixed: FixedMaps, B: torch.Tensor, A: torch.Tensor,
                  state: PassState, utilities: bool = True) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(utilities [L, N] or None, sketch [N, m]) of an AdamW group beyond the factor tolerance: the tensor sketch's
    hash on the formed P G_i. Each G_i = Σ_t b_t a_tᵀ is formed once, in chunks that stay in cache, and read
    twice: u_i = ⟨G_i, Q⟩ (where asked), then C·D ⊙ s1(o)s2(i) ⊙ G_i hashed (the map and the hash's signs in
    one pass)."""
    d_out, d_in = B.shape[-1], A.shape[-1]
    weights = fixed.map.apply(engine.sketcher(names, TensorSketch, d_out, d_in, state.seed, B.device).signs())
    rows = max(1, FORMED_ELEMENTS // weights[0].numel())
    u, sketches = [], []  # layer by layer (each layer's own sketcher hashes as the group's does)
    for k, name in enumerate(names):
        layer = engine.sketcher((name,), TensorSketch, d_out, d_in, state.seed, B.device)
        for i in range(0, B.shape[1], rows):
            G = torch.einsum("lnto,lnti->nloi", B[k : k + 1, i : i + rows], A[k : k + 1, i : i + rows])
            if utilities:
                u.append(G.flatten(1) @ fixed.Q[k].flatten())
            sketches.append(layer.signed_matrices(G.mul_(weights[k : k + 1])))
    sketch = torch.cat(sketches).view(len(names), B.shape[1], -1).sum(0)
    return (torch.cat(u).view(len(names), B.shape[1]) if utilities else None), sketch


def sq_norms(engine: GhostEngine, P: OptimizerMap, B: torch.Tensor, A: torch.Tensor) -> torch.Tensor:
    """[L, N] ‖P G_i‖² per layer."""
    T, d_out, d_in = B.shape[2], B.shape[-1], A.shape[-1]
    if P.exact_factors and 2 * T * T <= d_in * d_out:
        b2, a2 = P.token_factors(B, A)
        return ((a2 @ a2.mT) * (b2 @ b2.mT)).sum((2, 3))
    return torch.cat([G.pow(2).sum((2, 3)) for G in formed_pg(engine, P, B, A)], 1)
