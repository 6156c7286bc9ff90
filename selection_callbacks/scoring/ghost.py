"""Ghost-gradient engine: per-sample gradient geometry from one forward/backward, no per-sample gradients.

For a linear layer y_t = W a_t, sample i's gradient is G_i = Σ_t b_t a_tᵀ with b_t = ∂ℓ_i/∂y_t.
One forward over R = N candidate rows ++ P proxy rows captures a (forward hooks) and one
``torch.autograd.grad`` of Σ_r ℓ_r with respect to the earliest captured activations (the first
float input, plus the outputs of layers fed by ids) yields every b through tensor hooks, layer by layer, so b is consumed as it appears and no parameter ``.grad``
is read or written (gradient accumulation and DDP buckets are untouched). Per layer:

- proxy direction ḡ = (1/P) Σ_p G_p, preconditioned Q = P ḡ (P self-adjoint, see preconditioners);
- exact utilities u_i = ⟨P G_i, ḡ⟩ = Σ_t b_tᵀ Q a_t (one T·d_out·d_in product per candidate);
- optional m-dimensional sketches S_i with E⟨S_i, S_j⟩ = ⟨P G_i, P G_j⟩, summed over layers;
- optional squared norms ‖P G_i‖², by the T² Gram form where 2T² ≤ d_in·d_out, else materialised.
"""

from __future__ import annotations

from collections.abc import Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn as nn

from selection_callbacks.scoring.preconditioners import DiagonalMap, Preconditioner, ScalarMap
from selection_callbacks.scoring.sketch import CountSketch, TensorSketch, TwoSidedProjection

SketchKind = Literal["tensor", "count", "two_sided"]
Resolver = Callable[[nn.Parameter, torch.Tensor], Preconditioner]


@dataclass
class GhostScores:
    """What one scoring pass returns (candidates only; tensors on the model's device).

    Attributes:
        utilities: [N] Σ_layers ⟨P G_i, ḡ⟩.
        layer_utilities: layer name → [N].
        losses: [R] per-row losses (candidates then proxy).
        sketches: [N, m] or None.
        sq_norms: [N] Σ_layers ‖P G_i‖² or None.
        factor_error: layer name → relative error of AdamW's rank-1 D ≈ r cᵀ (tensor/two-sided sketches).
        shared: layers whose output has no row dimension (e.g. a position table): not scored.
    """

    utilities: torch.Tensor
    layer_utilities: dict[str, torch.Tensor]
    losses: torch.Tensor
    sketches: torch.Tensor | None = None
    sq_norms: torch.Tensor | None = None
    factor_error: dict[str, torch.Tensor] = field(default_factory=dict)
    shared: list[str] = field(default_factory=list)


def scored_layers(
    model: nn.Module, include_embedding: bool = False, include_head: bool = False, exclude: tuple[str, ...] = ()
) -> list[tuple[str, nn.Module]]:
    """Every ``nn.Linear`` (the output head only if asked) and, if asked, every ``nn.Embedding``.

    A position table (an embedding looked up with 1-D ids and broadcast over rows) cannot be
    captured per sample; the engine skips it and lists it in ``GhostScores.shared``.
    """
    out = []
    for name, module in model.named_modules():
        if name in exclude:
            continue
        if isinstance(module, nn.Linear):
            is_head = getattr(module, "is_output_head", False) or name.split(".")[-1] == "lm_head"
            if include_head or not is_head:
                out.append((name, module))
        elif isinstance(module, nn.Embedding) and include_embedding:
            out.append((name, module))
    if not out:
        raise ValueError(f"{type(model).__name__} has no nn.Linear layers to score")
    return out


class GhostEngine:
    """Scores candidates against a proxy batch with hook-captured ghost gradients.

    Example::

        engine = GhostEngine(pl_module.model, sketch_dim=1024)
        scores = engine.score(pl_module.per_sample_loss, rows, n_candidates=N,
                              preconditioner=OptimizerPreconditioner(optimizer))

    Args:
        model: the (unwrapped) module whose layers are scored.
        include_embedding: also score ``nn.Embedding`` weights.
        include_head: also score the output head (``lm_head`` / ``is_output_head``).
        sketch_dim: m; 0 disables sketches.
        sketch: ``"tensor"`` (TensorSketch; AdamW through its rank-1 factorised D), ``"count"``
            (exact CountSketch of materialised P G_i, the reference) or ``"two_sided"``.
        norms: also compute ‖P G_i‖².
        chunk: candidates per chunk where per-sample matrices are materialised.
        exclude: module names not to score (e.g. a layer applied twice per forward).
    """

    def __init__(
        self,
        model: nn.Module,
        include_embedding: bool = False,
        include_head: bool = False,
        sketch_dim: int = 0,
        sketch: SketchKind = "tensor",
        norms: bool = False,
        chunk: int = 8,
        exclude: tuple[str, ...] = (),
    ) -> None:
        if sketch not in ("tensor", "count", "two_sided"):
            raise ValueError(f"unknown sketch {sketch!r}; choose tensor, count or two_sided")
        self.model = model
        self.layers = scored_layers(model, include_embedding, include_head, tuple(exclude))
        self.sketch_dim, self.sketch, self.norms, self.chunk = sketch_dim, sketch, norms, chunk
        self._sketchers: dict[tuple[str, int], object] = {}

    # ---- capture ----
    def score(
        self,
        loss_fn: Callable[[MutableMapping], torch.Tensor],
        rows: MutableMapping,
        n_candidates: int,
        preconditioner: Resolver,
        seed: int = 0,
    ) -> GhostScores:
        """One forward/backward over ``rows`` (candidates first, then ≥ 1 proxy rows)."""
        n_rows = rows["input_ids"].shape[0]
        if not 0 < n_candidates < n_rows:
            raise ValueError(f"need candidates and ≥ 1 proxy row: N={n_candidates} of R={n_rows} rows")
        state = _PassState(n_candidates, n_rows - n_candidates, preconditioner, seed)
        handles = [m.register_forward_hook(self._forward_hook(name, state), with_kwargs=True) for name, m in self.layers]
        try:
            with torch.enable_grad():
                losses = loss_fn(rows)
                if not state.roots:
                    raise RuntimeError("ghost capture: no scored layer ran with gradients enabled")
                torch.autograd.grad(losses.sum(), state.roots, allow_unused=True)
        finally:
            for h in handles:
                h.remove()
        fired = set(state.utilities)
        missing = [name for name, _ in self.layers if name not in fired and name not in state.shared]
        if missing:
            raise RuntimeError(
                f"ghost capture saw {len(fired)} of {len(self.layers)} layers (missing e.g. {missing[:3]}): hooks did not "
                "fire, as under torch.compile; score the eager module instead of returning partial scores"
            )
        utilities = torch.stack(list(state.utilities.values())).sum(0)
        return GhostScores(
            utilities=utilities,
            layer_utilities=dict(state.utilities),
            losses=losses.detach(),
            sketches=state.sketch,
            sq_norms=state.sq_norms,
            factor_error=state.factor_error,
            shared=state.shared,
        )

    def _forward_hook(self, name: str, state: "_PassState") -> Callable:
        def hook(module: nn.Module, args: tuple, kwargs: dict, output: torch.Tensor) -> None:
            if not torch.is_grad_enabled() or not output.requires_grad:
                return
            if name in state.seen:
                raise RuntimeError(
                    f"ghost scoring: layer {name!r} ran twice in one forward (shared weights); its per-sample "
                    "gradient would mix both calls: pass exclude=[...] to score the other layers"
                )
            state.seen.add(name)
            x = args[0] if args else next(iter(kwargs.values()))
            rows = state.n + state.p
            if isinstance(module, nn.Embedding) and x.ndim == 1:  # a position table, broadcast over rows
                state.shared.append(name)
                return
            if x.ndim < 2 or x.shape[0] != rows:
                raise ValueError(
                    f"ghost scoring: layer {name!r} got input of shape {tuple(x.shape)}; scored layers need "
                    f"batch-first inputs [R={rows}, ...] (exclude the layer or keep the row dimension)"
                )
            if not (x.is_floating_point() and x.requires_grad):
                state.roots.append(output)  # a branch that starts here (token ids, raw features)
            elif not state.roots:
                state.roots.append(x)  # the earliest activation: the backward to it reaches every later layer
            captured = x.detach()
            output.register_hook(lambda grad: self._layer_backward(name, module, captured, grad, state))

        return hook

    # ---- per-layer math ----
    def _layer_backward(self, name: str, module: nn.Module, a: torch.Tensor, grad: torch.Tensor, state: "_PassState") -> None:
        R, N = grad.shape[0], state.n
        B = grad.reshape(R, -1, grad.shape[-1]).float()
        if isinstance(module, nn.Embedding):
            self._embedding(name, module, a.reshape(R, -1), B, state)
            return
        A = a.reshape(R, -1, a.shape[-1]).float()
        gbar = torch.einsum("pto,pti->oi", B[N:], A[N:]) / state.p
        pre = state.resolve(module.weight, gbar)
        Q = pre.apply(gbar)
        u = ((B[:N] @ Q) * A[:N]).sum((1, 2))
        bias_pg = None
        if module.bias is not None:  # G_bias = Σ_t b_t
            gbar_b = B[N:].sum(1).mean(0)
            bias_pg = state.resolve(module.bias, gbar_b).apply(B[:N].sum(1))  # [N, d_out]
            u = u + bias_pg @ gbar_b
        state.utilities[name] = u
        if self.sketch_dim:
            state.add_sketch(self._sketch_linear(name, pre, B[:N], A[:N], state))
            if bias_pg is not None:
                cs = self._sketcher(name + ".bias", CountSketch, bias_pg.shape[1], 1, state.seed, B.device)
                state.add_sketch(cs(bias_pg[:, :, None]))
            if isinstance(pre, DiagonalMap) and self.sketch != "count":
                state.factor_error[name] = pre.factor_error
        if self.norms:
            state.add_norm(self._sq_norms(pre, B[:N], A[:N]) + (0.0 if bias_pg is None else bias_pg.pow(2).sum(1)))

    def _sketcher(self, name: str, cls: type, d_out: int, d_in: int, seed: int, device: torch.device):
        key = (f"{name}:{cls.__name__}", seed)
        if key not in self._sketchers:
            names = [n for n, _ in self.layers]
            layer = names.index(name) if name in names else len(names) + names.index(name.rsplit(".", 1)[0])
            self._sketchers = {k: v for k, v in self._sketchers.items() if k[1] == seed}
            self._sketchers[key] = cls(self.sketch_dim, d_out, d_in, seed, layer, device)
        return self._sketchers[key]

    def _materialised(self, pre: Preconditioner, B: torch.Tensor, A: torch.Tensor):
        for i in range(0, B.shape[0], self.chunk):
            yield pre.apply(torch.einsum("nto,nti->noi", B[i : i + self.chunk], A[i : i + self.chunk]))

    def _sketch_linear(self, name: str, pre: Preconditioner, B: torch.Tensor, A: torch.Tensor, state: "_PassState") -> torch.Tensor:
        d_out, d_in = B.shape[-1], A.shape[-1]
        if self.sketch == "count":
            cs = self._sketcher(name, CountSketch, d_out, d_in, state.seed, B.device)
            return torch.cat([cs(G) for G in self._materialised(pre, B, A)])
        cls = TensorSketch if self.sketch == "tensor" else TwoSidedProjection
        b2, a2 = pre.token_factors(B, A)
        return self._sketcher(name, cls, d_out, d_in, state.seed, B.device)(b2, a2)

    def _sq_norms(self, pre: Preconditioner, B: torch.Tensor, A: torch.Tensor) -> torch.Tensor:
        T, d_out, d_in = B.shape[1], B.shape[-1], A.shape[-1]
        if pre.exact_factors and 2 * T * T <= d_in * d_out:
            b2, a2 = pre.token_factors(B, A)
            return ((a2 @ a2.transpose(1, 2)) * (b2 @ b2.transpose(1, 2))).sum((1, 2))
        return torch.cat([G.pow(2).sum((1, 2)) for G in self._materialised(pre, B, A)])

    def _embedding(self, name: str, module: nn.Embedding, ids: torch.Tensor, B: torch.Tensor, state: "_PassState") -> None:
        N, V, d = state.n, module.num_embeddings, B.shape[-1]
        gbar = torch.zeros(V, d, device=B.device).index_add_(0, ids[N:].reshape(-1), B[N:].reshape(-1, d)) / state.p
        pre = state.resolve(module.weight, gbar)
        state.utilities[name] = (pre.apply(gbar)[ids[:N]] * B[:N]).sum((1, 2))
        if isinstance(pre, DiagonalMap):
            rows = pre.C * pre.D[ids[:N]] * B[:N]
        elif isinstance(pre, ScalarMap):
            rows = pre.c * B[:N]
        else:
            raise TypeError(f"embedding {name!r} is preconditioned by {type(pre).__name__}; only elementwise maps apply")
        if self.sketch_dim:
            if self.sketch == "tensor":
                state.add_sketch(self._sketcher(name, TensorSketch, V, d, state.seed, B.device).one_hot(rows, ids[:N], V))
            elif self.sketch == "count":
                cs = self._sketcher(name, CountSketch, V, d, state.seed, B.device)
                state.add_sketch(torch.cat([cs(G) for G in self._embedding_mats(ids[:N], rows, V)]))
            else:
                raise ValueError("two-sided sketches do not cover embeddings; use sketch='tensor' or 'count'")
        if self.norms:
            state.add_norm(torch.cat([G.pow(2).sum((1, 2)) for G in self._embedding_mats(ids[:N], rows, V)]))

    def _embedding_mats(self, ids: torch.Tensor, rows: torch.Tensor, vocab: int):
        """Per-sample P G_i = Σ_t e_{x_t} b'_tᵀ as [chunk, V, d] matrices."""
        for k in range(0, ids.shape[0], self.chunk):
            yield torch.stack(
                [torch.zeros(vocab, rows.shape[-1], device=rows.device).index_add_(0, i, r)
                 for i, r in zip(ids[k : k + self.chunk], rows[k : k + self.chunk])]
            )


class _PassState:
    """Accumulators of one scoring pass."""

    def __init__(self, n: int, p: int, resolve: Resolver, seed: int) -> None:
        self.n, self.p, self.resolve, self.seed = n, p, resolve, seed
        self.roots: list[torch.Tensor] = []
        self.shared: list[str] = []
        self.seen: set[str] = set()
        self.utilities: dict[str, torch.Tensor] = {}
        self.sketch: torch.Tensor | None = None
        self.sq_norms: torch.Tensor | None = None
        self.factor_error: dict[str, torch.Tensor] = {}

    def add_sketch(self, s: torch.Tensor) -> None:
        self.sketch = s if self.sketch is None else self.sketch + s

    def add_norm(self, v: torch.Tensor) -> None:
        self.sq_norms = v if self.sq_norms is None else self.sq_norms + v


def check_precision(trainer) -> None:
    """Refuse fp16 mixed precision with a GradScaler: it would scale the scoring gradients.

    bf16 autocast and fp32 are fine (captured tensors are promoted to fp32 for the contractions).
    """
    if getattr(trainer.precision_plugin, "scaler", None) is not None:
        raise ValueError(
            "ghost scoring does not run under fp16 GradScaler (precision='16-mixed'): the scaler multiplies the "
            "backward and its overflow skipping would corrupt scores; use precision='bf16-mixed' or '32-true'"
        )
