"""Ghost-gradient engine: per-sample gradient geometry from one forward/backward, no per-sample gradients.

For a linear layer y_t = W a_t, sample i's gradient is G_i = Σ_t b_t a_tᵀ with b_t = ∂ℓ_i/∂y_t.
transformers' ``Conv1D`` (GPT-2) stores W as [in, out], y_t = Wᵀ a_t: the engine works in the stored
orientation, G_i = Σ_t a_t b_tᵀ, so the optimizer's map of the stored parameter (a Muon group's
rescaled lr included) applies as it is. A weight shared by several layers (a head tied to the token
embedding) is one parameter: its per-sample gradient is the sum of its uses', and it is scored once.
One forward over R = N candidate rows ++ P proxy rows captures a (forward hooks) and one
``torch.autograd.grad`` of Σ_r ℓ_r with respect to the earliest captured activations (the first
float input, plus the outputs of layers fed by ids) yields every b through tensor hooks; no
parameter ``.grad`` is read or written (gradient accumulation and DDP buckets are untouched).
With ``candidate_chunk`` the proxy rows ride with the first chunk of candidates (fixing each
layer's P and Q) and the rest follow in chunks of their own, so activation memory does not grow
with N. Layers are scored inside the backward, as soon as their output gradients arrive. On an
accelerator, layers of one shape and one optimizer group are stacked and scored together when the
group's last gradient arrives (one kernel per group rather than per layer: a GPU is launch-bound at
these sizes); on a CPU each layer is scored alone (stacking only copies there). Per layer:

- proxy direction ḡ = (1/P) Σ_p G_p and the utility vector Q = −Jᵀḡ of the step's derivative J
  (``Preconditioner.utility_vector``; Q = P ḡ for the self-adjoint SGD and AdamW maps; Muon's J
  is the exact vector–Jacobian product of its Newton–Schulz iteration);
- exact utilities u_i = ⟨G_i, Q⟩ = Σ_t b_tᵀ Q a_t (one T·d_out·d_in product per candidate);
- optional m-dimensional sketches S_i with E⟨S_i, S_j⟩ = ⟨P G_i, P G_j⟩, summed over layers (a tensor
  sketch gives each layer its own block of bins, in proportion to its size: its cost is linear in the block).
  The tensor sketch hashes each token's factors P(b aᵀ) = b' a'ᵀ: exact for SGD and for Muon's frozen
  Newton–Schulz map L g. AdamW's D ⊙ (b aᵀ) factors only through a rank-1 D ≈ κ r cᵀ (rescaled so
  squared norms stay unbiased under Adam's normalisation, :attr:`DiagonalMap.norm_scale`), whose error
  is large where v is far from rank-1 (early steps; an output head with rows never seen), so an AdamW
  stack is sketched through the factors only where ``DiagonalMap.relative_factor_error`` ≤
  ``factor_tolerance``; elsewhere P G_i is formed in candidate chunks and hashed with the same
  TensorSketch hash (:meth:`TensorSketch.matrices`): exact in expectation;
- optional probe: the sketch's real error on the first few candidates, against their exact Gram;
- optional squared norms ‖P G_i‖², by the T² Gram form where 2T² ≤ d_in·d_out, else materialised.
"""

from __future__ import annotations

from collections.abc import Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn as nn

from selection_callbacks.nn.heads import output_heads
from selection_callbacks.nn.flops import linear_flops_per_token
from selection_callbacks.nn.optim import conv1d_type
from selection_callbacks.scoring.preconditioners import DiagonalMap, Preconditioner, Resolver, ScalarMap, rows_matmul
from selection_callbacks.scoring.sketch import CountSketch, TensorSketch, TwoSidedProjection, sketch_blocks

SketchKind = Literal["tensor", "count", "two_sided"]
STACK_ROW_ELEMENTS = 1 << 20  # numbers of captured a and b per row in one stack of layers
FACTOR_TOLERANCE = 0.3  # ρ up to which AdamW stacks are sketched through κ r cᵀ (bench/results/ghost/README.md, "Rescaled factors")
MATERIALISED_ELEMENTS = 1 << 19  # numbers of formed P G_i per chunk where a tensor sketch forms them (2 MB: the passes stay in cache)


@dataclass
class GhostScores:
    """What one scoring pass returns (candidates only; tensors on the model's device).

    Attributes:
        utilities: [N] Σ_layers ⟨G_i, −Jᵀḡ⟩ (= ⟨P G_i, ḡ⟩ for self-adjoint maps).
        layer_utilities: layer name → [N] (a weight and its bias together; a shared weight under its first layer).
        losses: [R] per-row losses (candidates then proxy).
        sketches: [N, m] or None.
        sq_norms: [N] Σ_layers ‖P G_i‖² or None.
        factor_error: layer name → ‖D − r cᵀ‖_F/‖D‖_F of AdamW's rank-1 factorisation (tensor/two-sided sketches;
            empty when ``score(factor_errors=False)``); not the sketch's error (see ``relative_factor_error``, ``sketch_error``).
        relative_factor_error: layer name → ρ of that factorisation (:attr:`DiagonalMap.relative_factor_error`).
        factored: the AdamW layers whose sketch went through the rank-1 factors (the rest were formed exactly).
        sketch_error: with ``probe`` = k: ``"gram"``, the mean over the k(k−1)/2 pairs of
            |⟨S_i, S_j⟩ − ⟨P G_i, P G_j⟩| / (‖P G_i‖‖P G_j‖), and ``"sq_norm"``, the mean of ‖S_i‖²/‖P G_i‖² − 1
            (signed), over the first k candidates against their materialised P G_i (the sketch as used:
            hashing noise and any factorisation bias).
        shared: layers whose output has no row dimension (e.g. a position table): not scored.
    """

    utilities: torch.Tensor
    layer_utilities: dict[str, torch.Tensor]
    losses: torch.Tensor
    sketches: torch.Tensor | None = None
    sq_norms: torch.Tensor | None = None
    factor_error: dict[str, torch.Tensor] = field(default_factory=dict)
    relative_factor_error: dict[str, torch.Tensor] = field(default_factory=dict)
    factored: list[str] = field(default_factory=list)
    sketch_error: dict[str, torch.Tensor] = field(default_factory=dict)
    shared: list[str] = field(default_factory=list)


def linear_kind(module: nn.Module) -> Literal["linear", "conv1d"] | None:
    """``"linear"`` for ``nn.Linear`` (weight [out, in]), ``"conv1d"`` for transformers' ``Conv1D`` (weight [in, out])."""
    if isinstance(module, nn.Linear):
        return "linear"
    conv1d = conv1d_type()
    return "conv1d" if conv1d is not None and isinstance(module, conv1d) else None


def unscorable_layers(model: nn.Module) -> list[str]:
    """Modules holding a trainable parameter of ≥ 2 dimensions the engine has no ghost form for: neither
    ``nn.Linear``, ``Conv1D`` nor ``nn.Embedding`` (norms, rotary tables and activations hold none)."""
    return [name for name, module in model.named_modules()
            if linear_kind(module) is None and not isinstance(module, nn.Embedding)
            and any(p.ndim >= 2 and p.requires_grad for p in module.parameters(recurse=False))]


def scored_layers(
    model: nn.Module, include_embedding: bool = False, include_head: bool = False, exclude: tuple[str, ...] = ()
) -> list[tuple[str, nn.Module]]:
    """Every linear layer (``nn.Linear``, transformers' ``Conv1D``; the output head only if asked) and, if
    asked, every ``nn.Embedding``, in registration order.

    The head is found structurally (:func:`selection_callbacks.nn.heads.output_heads`: marked,
    tied to the embedding, or the vocabulary-sized Linear). A weight shared by several modules (a
    head tied to the token embedding) is one parameter: when either flag asks for one of its
    modules, all of them are listed (:class:`GhostEngine` scores them as one), and ``exclude``
    must name all of them or none. A position table (an embedding looked up with ids broadcast
    over rows) cannot be captured per sample; the engine skips it and lists it in
    ``GhostScores.shared``. Modules with parameters of fewer than two dimensions (norm gains) or
    none (rotary embeddings) are not scored and need no hooks; any other module with a trainable
    ≥ 2-D parameter (:func:`unscorable_layers`) is an error unless ``exclude`` names it.
    """
    unscorable = [name for name in unscorable_layers(model) if name not in exclude]
    if unscorable:
        module = model.get_submodule(unscorable[0])
        shapes = {n: tuple(p.shape) for n, p in module.named_parameters(recurse=False) if p.ndim >= 2}
        raise TypeError(
            f"ghost scoring has no per-sample gradient form for layer {unscorable[0]!r} ({type(module).__name__}, "
            f"parameters {shapes}; {len(unscorable)} such layer(s): {unscorable[:4]}): it scores nn.Linear, "
            "transformers Conv1D and nn.Embedding weights. Leave the layer out with layers=[...] (OPUS/GREATS: "
            "glob patterns of the layers to score, which it must not match) or exclude=(...) (GhostEngine), "
            "or freeze its parameters"
        )
    heads = output_heads(model)
    candidates, wanted = [], set()
    for name, module in model.named_modules():
        if linear_kind(module) is not None:
            asked = include_head or name not in heads
        elif isinstance(module, nn.Embedding):
            asked = include_embedding
        else:
            continue
        candidates.append((name, module))
        if asked and name not in exclude:
            wanted.add(id(module.weight))
    out = [(name, m) for name, m in candidates if id(m.weight) in wanted]
    for names in shared_weights(out):
        if any(n in exclude for n in names):
            raise ValueError(f"layers {list(names)} share one weight (tied): exclude all of them or none, got exclude={list(exclude)}")
    if not out:
        raise ValueError(f"{type(model).__name__} has no linear layers (nn.Linear, Conv1D) to score")
    return out


def shared_weights(layers: list[tuple[str, nn.Module]]) -> list[tuple[str, ...]]:
    """Names of the layers that share one weight, per shared weight (in layer order; unshared weights left out)."""
    uses: dict[int, list[str]] = {}
    for name, module in layers:
        uses.setdefault(id(module.weight), []).append(name)
    return [tuple(names) for names in uses.values() if len(names) > 1]


class GhostEngine:
    """Scores candidates against a proxy batch with hook-captured ghost gradients.

    Example::

        engine = GhostEngine(pl_module.model, sketch_dim=1024)
        scores = engine.score(pl_module.per_sample_loss, rows, n_candidates=N,
                              preconditioner=OptimizerPreconditioner(optimizer))

    Args:
        model: the (unwrapped) module whose layers are scored.
        include_embedding: also score ``nn.Embedding`` weights.
        include_head: also score the output head (found by :func:`~selection_callbacks.nn.heads.output_heads`).
            A head tied to the embedding is one weight: either flag scores it, over both uses.
        sketch_dim: m; 0 disables sketches. With ``"tensor"`` each scored layer owns a block of the
            bins in proportion to its weight size (:func:`sketch_blocks`), at least one.
        sketch: ``"tensor"`` (TensorSketch of the token factors; AdamW layers per ``factor_tolerance``), ``"count"``
            (exact CountSketch of materialised P G_i, the reference) or ``"two_sided"`` (AdamW through its
            rank-1 factorised D).
        factor_tolerance: with ``"tensor"``, an AdamW stack is sketched through its rescaled rank-1 factors where
            its largest ρ (:attr:`DiagonalMap.relative_factor_error`) is at most this (one device sync per stack
            and call), else from P G_i formed in ``chunk``-candidate chunks (0: always formed, unbiased;
            ∞: always factored).
        norms: also compute ‖P G_i‖².
        chunk: candidates per chunk where per-sample matrices are materialised.
        exclude: module names not to score (e.g. a layer applied twice per forward).
        candidate_chunk: score candidates in forward/backward passes of at most this many rows
            (the proxy rows ride with the first), so activation memory stays flat in N (None: one
            pass over all rows, the fastest for small N). Rows must not interact (no batch norm).
            Scores equal one pass's.
        stack_layers: score same-shaped layers of one optimizer group as one stack (None: on
            accelerators; on a CPU, where it copies the captures and saves no launches, only the
            layers whose map gains from it, Muon's: :func:`stack_by_default`).
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
        candidate_chunk: int | None = None,
        stack_layers: bool | None = None,
        factor_tolerance: float = FACTOR_TOLERANCE,
    ) -> None:
        if sketch not in ("tensor", "count", "two_sided"):
            raise ValueError(f"unknown sketch {sketch!r}; choose tensor, count or two_sided")
        self.model = model
        self.layers = scored_layers(model, include_embedding, include_head, tuple(exclude))
        if candidate_chunk is not None and candidate_chunk < 1:
            raise ValueError(f"candidate_chunk must be ≥ 1 or None, got {candidate_chunk}")
        self._tied = {name: names for names in shared_weights(self.layers) for name in names}
        for name, module in self.layers:
            if name in self._tied and getattr(module, "bias", None) is not None:
                raise ValueError(f"layer {name!r} shares its weight with {list(self._tied[name])} and has a bias: "
                                 "tied layers are scored without biases; exclude them")
        owners = [(name, m) for name, m in self.layers if self._tied.get(name, (name,))[0] == name]  # a shared weight once
        sizes = [module.weight.numel() for _, module in owners]
        self._blocks = dict(zip([name for name, _ in owners], sketch_blocks(sizes, sketch_dim))) if sketch == "tensor" and sketch_dim else {}
        self.sketch_dim, self.sketch, self.norms, self.chunk = sketch_dim, sketch, norms, chunk
        self.candidate_chunk, self.stack_layers, self.factor_tolerance = candidate_chunk, stack_layers, factor_tolerance
        self._modules = dict(self.layers)
        self._index = {name: i for i, (name, _) in enumerate(self.layers)}
        self._sketchers: dict[tuple, object] = {}
        self._backward_flops: int | None = None

    @property
    def backward_flops(self) -> int | None:
        """2 · Σ d_in·d_out over the linear layers the scoring backward runs through, per token (None before
        the first pass). The backward starts at the loss and stops at the earliest scored layer's input, so
        with only late layers scored (``exclude``) the layers before them cost no backward. Counted from the
        first pass's forward order (a layer applied twice counts twice)."""
        return self._backward_flops

    # ---- capture ----
    def score(
        self,
        loss_fn: Callable[[MutableMapping], torch.Tensor],
        rows: MutableMapping,
        n_candidates: int,
        preconditioner: Resolver,
        seed: int = 0,
        probe: int = 0,
        factor_errors: bool = True,
    ) -> GhostScores:
        """Scores of ``rows`` (candidates first, then ≥ 1 proxy rows).

        One forward/backward over all rows, or, with ``candidate_chunk`` = c < N, one over the
        first c candidates and the proxy rows (which fix each layer's P and Q), then one per
        further chunk of c candidates. ``probe`` = k ≥ 2 (with sketches) also forms P G_i of the first
        min(k, c) candidates in every layer and reports the sketch's error on them (``sketch_error``).
        ``factor_errors`` = False leaves out ``GhostScores.factor_error`` (a diagnostic: one pass over each
        AdamW layer's D); ρ, which picks the sketch path, is always computed.
        """
        n_rows = rows["input_ids"].shape[0]
        if not 0 < n_candidates < n_rows:
            raise ValueError(f"need candidates and ≥ 1 proxy row: N={n_candidates} of R={n_rows} rows")
        maps: dict[tuple[str, ...], _LayerMaps] = {}
        c = min(self.candidate_chunk or n_candidates, n_candidates)
        first = rows if c == n_candidates else take_rows(rows, torch.cat([torch.arange(c), torch.arange(n_candidates, n_rows)]), n_rows)
        head = _PassState(c, n_rows - n_candidates, preconditioner, seed, maps)
        head.factor_errors = factor_errors
        head.probe = min(probe, c) if self.sketch_dim and probe >= 2 else 0
        passes = [self._pass(loss_fn, first, head)]
        for lo in range(c, n_candidates, c):
            hi = min(lo + c, n_candidates)
            state = _PassState(hi - lo, 0, preconditioner, seed, maps)
            state.shared = list(passes[0].shared)  # a pass of one row cannot tell a broadcast table from a per-row one
            passes.append(self._pass(loss_fn, take_rows(rows, torch.arange(lo, hi), n_rows), state))
        losses = torch.cat([passes[0].losses[:c], *(s.losses for s in passes[1:]), passes[0].losses[c:]])
        order = [name for name, _ in self.layers if name in passes[0].utilities]
        layer_utilities = {name: torch.cat([s.utilities[name] for s in passes]) for name in order}
        sketches = [s.sketch for s in passes if s.sketch is not None]
        norms = [s.sq_norms for s in passes if s.sq_norms is not None]
        per_layer = lambda key: {name: getattr(m, key)[i] for names, m in maps.items() if getattr(m, key) is not None
                                 for i, name in enumerate(names)}
        return GhostScores(
            utilities=torch.stack(list(layer_utilities.values())).sum(0),
            layer_utilities=layer_utilities,
            losses=losses,
            sketches=torch.cat(sketches) if sketches else None,
            sq_norms=torch.cat(norms) if norms else None,
            factor_error=per_layer("factor_error"),
            relative_factor_error=per_layer("relative_factor_error"),
            factored=sorted((name for names, m in maps.items() if m.relative_factor_error is not None and m.factored for name in names),
                            key=self._index.__getitem__),
            sketch_error=_probe_errors(sketches[0][: head.probe], head.probe_gram) if head.probe else {},
            shared=passes[0].shared,
        )

    def _pass(self, loss_fn: Callable[[MutableMapping], torch.Tensor], rows: MutableMapping, state: "_PassState") -> "_PassState":
        """One forward/backward over ``rows`` with the capture hooks on, scoring inside it; fills ``state``."""
        handles = [m.register_forward_hook(self._forward_hook(name, state), with_kwargs=True) for name, m in self.layers]
        if self._backward_flops is None:  # every linear layer's forward, in order, once
            state.calls = []
            handles += [m.register_forward_pre_hook(lambda module, args: state.calls.append(module))
                        for m in self.model.modules() if linear_kind(m) is not None]
        try:
            with torch.enable_grad():
                losses = loss_fn(rows)
                if not state.roots:
                    raise RuntimeError("ghost capture: no scored layer ran with gradients enabled")
                for names in self._groups(state):
                    state.group_of.update((name, names) for name in names)
                if state.calls is not None:
                    self._backward_flops = linear_flops_per_token(state.calls[state.root_call :])
                torch.autograd.grad(losses.sum(), state.roots, allow_unused=True)
                state.roots.clear()  # the pass's states outlive it; its activations need not
        finally:
            for h in handles:
                h.remove()
        missing = [name for name, _ in self.layers if name not in state.utilities and name not in state.shared
                   and self._tied.get(name, (name,))[0] == name]  # a shared weight's utilities are its first layer's
        if missing:  # every pass carries ≥ 1 candidate, so a scored layer has utilities
            raise RuntimeError(
                f"ghost capture scored {len(state.utilities)} of {len(self.layers)} layers (missing e.g. {missing[:3]}): hooks "
                "did not fire, as under torch.compile; score the eager module instead of returning partial scores"
            )
        state.losses = losses.detach()
        return state

    def _forward_hook(self, name: str, state: "_PassState") -> Callable:
        def hook(module: nn.Module, args: tuple, kwargs: dict, output: torch.Tensor) -> None:
            if not torch.is_grad_enabled() or not output.requires_grad:
                return
            if name in state.inputs:
                raise RuntimeError(
                    f"ghost scoring: layer {name!r} ran twice in one forward (one module applied twice); its per-sample "
                    "gradient would mix both calls: pass exclude=[...] to score the other layers"
                )
            if name in state.shared:
                return
            x = args[0] if args else next(iter(kwargs.values()))
            rows = state.n + state.p
            if isinstance(module, nn.Embedding) and (x.ndim == 1 or x.shape[0] == 1 < rows):  # a position table, broadcast over rows
                state.shared.append(name)
                return
            if x.ndim < 2 or x.shape[0] != rows:
                raise ValueError(
                    f"ghost scoring: layer {name!r} got input of shape {tuple(x.shape)}; scored layers need "
                    f"batch-first inputs [R={rows}, ...] (exclude the layer or keep the row dimension)"
                )
            if not state.roots and state.calls is not None:  # the backward reaches this layer and every later one
                state.root_call = len(state.calls) - (linear_kind(module) is not None)
            if not (x.is_floating_point() and x.requires_grad):
                state.roots.append(output)  # a branch that starts here (token ids, raw features)
            elif not state.roots:
                state.roots.append(x)  # the earliest activation: the backward to it reaches every later layer
            state.inputs[name] = x.detach()
            state.out_shapes[name] = output.shape
            output.register_hook(lambda grad: self._arrived(name, grad, state))

        return hook

    def _arrived(self, name: str, grad: torch.Tensor, state: "_PassState") -> None:
        """Tensor hook: keep b; once every layer of its group has its b, score the group (in float32)."""
        state.grads[name] = grad
        names = state.group_of[name]
        if all(n in state.grads for n in names):
            with torch.no_grad(), torch.autocast(grad.device.type, enabled=False):
                self._group_scores(names, state)

    def _groups(self, state: "_PassState") -> list[tuple[str, ...]]:
        """Captured layers grouped for stacking (after the forward, before the backward): same weight
        and bias shapes, optimizer groups and captured shapes, split so that one stack holds at most
        ``STACK_ROW_ELEMENTS`` numbers per row (the split depends on per-row sizes only, so every pass
        of a scoring call groups alike). A layer that does not stack (``stack_layers``) is its own group.

        Embeddings stay alone (their sketch and norm paths are per table); the layers sharing one weight
        form one group of their own (:meth:`_tied_scores`).
        """
        groups: dict[tuple, list[str]] = {}
        for name, module in self.layers:
            if name not in state.inputs:
                continue
            if name in self._tied:  # one weight, one group of its uses
                key: tuple = self._tied[name]
            elif isinstance(module, nn.Embedding) or not self._stacks(module.weight, state.resolve):
                key = (name,)
            else:
                bias = module.bias
                key = (linear_kind(module), module.weight.shape, state.resolve.group_key(module.weight), bias is None,
                       None if bias is None else state.resolve.group_key(bias),
                       state.inputs[name].shape[1:], state.out_shapes[name][1:])
            groups.setdefault(key, []).append(name)
        out: list[tuple[str, ...]] = []
        for names in groups.values():
            members: list[str] = []
            for name in names:
                per_row = (state.inputs[name][0].numel() + state.out_shapes[name][1:].numel()) * (len(members) + 1)
                if members and per_row > STACK_ROW_ELEMENTS and name not in self._tied:
                    out.append(tuple(members))
                    members = []
                members.append(name)
            out.append(tuple(members))
        return out

    def _stacks(self, weight: torch.Tensor, resolve: Resolver) -> bool:
        return self.stack_layers if self.stack_layers is not None else stack_by_default(weight.device, resolve, weight)

    # ---- per-group math ----
    def _group_scores(self, names: tuple[str, ...], state: "_PassState") -> None:
        """The scores of same-shaped layers ``names``, stacked in the weight's stored orientation:
        B [L, R, T, rows], A [L, R, T, cols], G = Σ_t b_t a_tᵀ [rows, cols]. A Linear's rows are its
        outputs (B the output gradients, A the inputs); a Conv1D's weight is stored [in, out], so B
        is its inputs and A its output gradients."""
        if names[0] in self._tied:
            self._tied_scores(names, state)
            return
        modules = [self._modules[name] for name in names]
        inputs = [state.inputs.pop(name) for name in names]
        grads = [state.grads.pop(name) for name in names]
        R, N = grads[0].shape[0], state.n
        if isinstance(modules[0], nn.Embedding):
            self._embedding(names[0], modules[0], inputs[0].reshape(R, -1), grads[0].reshape(R, -1, grads[0].shape[-1]).float(), state)
            return
        B, A, out = self._factors(modules[0], _stack(inputs), _stack(grads))
        del inputs, grads
        maps = state.maps.get(names)
        if maps is None:  # the pass carrying the proxy rows fixes the group's maps
            maps = state.maps[names] = self._linear_maps(modules, B, A, out, state)
        if N == 0:
            return
        B, A, out = B[:, :N], A[:, :N], out[:, :N]
        formed = not maps.factored  # only a tensor sketch's AdamW stacks beyond the tolerance (_choose_sketch_path)
        if formed:  # the sketch forms every G_i: the utilities read them instead of a product of their own
            u, sketch = self._formed_sketch(names, maps, B, A, state)
        else:
            u = _linear_utilities(B, A, maps.Q)
        bias_pg = None
        if maps.bias_pre is not None:  # G_bias = Σ_t ∂ℓ/∂y_t
            g_bias = out.sum(2)  # [L, N, d_out]
            u = u + (g_bias * maps.Q_bias[:, None, :]).sum(-1)
            if self.sketch_dim or self.norms:
                bias_pg = maps.bias_pre.apply(g_bias)
        state.utilities.update(zip(names, u.unbind(0)))
        if self.sketch_dim:
            state.add_sketch(sketch if formed else self._sketch_linear(names, maps, B, A, state))
            if bias_pg is not None:
                cs = self._sketcher(tuple(n + ".bias" for n in names), CountSketch, bias_pg.shape[-1], 1, state.seed, B.device)
                state.add_sketch(cs(bias_pg[..., None]))
            if state.probe:
                k = state.probe
                state.add_probe(*self._materialised(maps.pre, B[:, :k], A[:, :k], chunk=k), *(() if bias_pg is None else (bias_pg[:, :k],)))
        if self.norms:
            sq = self._sq_norms(maps.pre, B, A).sum(0)
            state.add_norm(sq if bias_pg is None else sq + bias_pg.pow(2).sum((0, 2)))

    @staticmethod
    def _factors(module: nn.Module, inputs: torch.Tensor, grads: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(B [L, R, T, rows], A [L, R, T, cols], output gradients [L, R, T, d_out]) in float32 from stacked
        captures: the weight's stored orientation (views, no copies)."""
        L, R = grads.shape[0], grads.shape[1]
        out = grads.reshape(L, R, -1, grads.shape[-1]).float()
        x = inputs.reshape(L, R, -1, inputs.shape[-1]).float()
        return (x, out, out) if linear_kind(module) == "conv1d" else (out, x, out)

    def _linear_maps(
        self, modules: list[nn.Module], B: torch.Tensor, A: torch.Tensor, out: torch.Tensor, state: "_PassState"
    ) -> "_LayerMaps":
        """P and Q = −Jᵀḡ of stacked linear layers from the pass's B [L, n + P, T, rows], A [L, n + P, T, cols]
        and output gradients ``out`` (for biases); the proxy rows fix ḡ."""
        n = state.n
        gbar = (B[:, n:].flatten(1, 2).mT @ A[:, n:].flatten(1, 2)).div_(state.proxy_rows())  # Σ_p Σ_t b aᵀ / P, [L, rows, cols]
        pre = state.resolve([m.weight for m in modules], gbar)
        maps = _LayerMaps(pre, pre.utility_vector(gbar))
        if modules[0].bias is not None:
            gbar_bias = out[:, n:].sum(2).mean(1)
            maps.bias_pre = state.resolve([m.bias for m in modules], gbar_bias)
            maps.Q_bias = maps.bias_pre.utility_vector(gbar_bias)
        self._choose_sketch_path(maps, state.factor_errors)
        return maps

    def _choose_sketch_path(self, maps: "_LayerMaps", factor_errors: bool) -> None:
        """For an AdamW map sketched by hashing: its ρ (and, if asked, its Frobenius factor error), and whether the
        sketch goes through the rank-1 factors (two-sided always; tensor where ρ ≤ ``factor_tolerance``) or through
        the formed P G_i."""
        pre = maps.pre
        if self.sketch_dim and self.sketch != "count" and isinstance(pre, DiagonalMap):
            maps.relative_factor_error = pre.relative_factor_error
            maps.factor_error = pre.factor_error if factor_errors else None
            maps.factored = self.sketch == "two_sided" or (
                self.factor_tolerance > 0 and float(maps.relative_factor_error.max()) <= self.factor_tolerance)

    def _tied_scores(self, names: tuple[str, ...], state: "_PassState") -> None:
        """One weight W shared by the layers ``names`` (a head tied to the token embedding), scored once under
        the first name: its per-sample gradient is the sum over its uses, G_i = Σ_k G_i^(k), so ḡ sums the uses'
        proxy gradients, P and Q = −Jᵀḡ are resolved once and u_i = Σ_k ⟨G_i^(k), Q⟩ is exact. The uses' sketches
        go through one sketcher (a linear sketch of the sum); ‖P G_i‖² is taken over the materialised sum."""
        first, N = names[0], state.n
        weight = self._modules[first].weight
        uses = []  # ("embedding", ids [R, T], B [R, T, d]) or ("linear", B [1, R, T, rows], A [1, R, T, cols])
        for name in names:
            x, g = state.inputs.pop(name), state.grads.pop(name)
            if isinstance(self._modules[name], nn.Embedding):
                uses.append(("embedding", x.reshape(g.shape[0], -1), g.reshape(g.shape[0], -1, g.shape[-1]).float()))
            else:
                uses.append(("linear", *self._factors(self._modules[name], x[None], g[None])[:2]))
        maps = state.maps.get((first,))
        if maps is None:
            gbar = torch.zeros(weight.shape, device=uses[0][2].device)
            for kind, left, right in uses:
                if kind == "embedding":
                    gbar.index_add_(0, left[N:].reshape(-1), right[N:].reshape(-1, right.shape[-1]))
                else:
                    gbar += left[0, N:].flatten(0, 1).mT @ right[0, N:].flatten(0, 1)
            gbar = gbar.div_(state.proxy_rows())[None]
            pre = state.resolve([weight], gbar)
            if any(kind == "embedding" for kind, *_ in uses) and not isinstance(pre, (DiagonalMap, ScalarMap)):
                raise TypeError(f"embedding {first!r} is preconditioned by {type(pre).__name__}; only elementwise maps apply")
            maps = state.maps[(first,)] = _LayerMaps(pre, pre.utility_vector(gbar))
            self._choose_sketch_path(maps, state.factor_errors)
        if N == 0:
            return
        pre, u, mats = maps.pre, 0.0, []
        for kind, left, right in uses:
            if kind == "embedding":
                ids, B = left[:N], right[:N]
                u = u + (maps.Q[0][ids] * B).sum((1, 2))
                rows = self._embedding_rows(pre, ids, B)
                if self.sketch_dim:
                    state.add_sketch(self._embedding_sketch(first, ids, rows, weight.shape[0], state))
                mats.append(self._embedding_mats(ids, rows, weight.shape[0]))
            else:
                B, A = left[:, :N], right[:, :N]
                u = u + _linear_utilities(B, A, maps.Q)[0]
                if self.sketch_dim:
                    state.add_sketch(self._sketch_linear((first,), maps, B, A, state))
                mats.append(G[0] for G in self._materialised(pre, B, A))
        state.utilities[first] = u
        if self.norms:
            state.add_norm(torch.cat([sum(chunks).pow(2).sum((1, 2)) for chunks in zip(*mats)]))

    def _sketcher(self, names: tuple[str, ...], cls: type, d_out: int, d_in: int, seed: int, device: torch.device):
        """The sketch of layers ``names`` (a bias is ``<layer>.bias``), hashed by (seed, layer index)."""
        key = (names, cls.__name__, seed)
        if key not in self._sketchers:
            layers = [self._index[n] if n in self._index else len(self._index) + self._index[n.rsplit(".", 1)[0]] for n in names]
            self._sketchers = {k: v for k, v in self._sketchers.items() if k[2] == seed}
            blocks = {"block": self._blocks[names[0]][1], "offsets": [self._blocks[n][0] for n in names]} if cls is TensorSketch else {}
            self._sketchers[key] = cls(self.sketch_dim, d_out, d_in, seed, layers, device, **blocks)
        return self._sketchers[key]

    def _materialised(self, pre: Preconditioner, B: torch.Tensor, A: torch.Tensor, chunk: int | None = None):
        """P G_i [L, chunk, d_out, d_in] in candidate chunks (of ``chunk``, default the engine's)."""
        chunk = chunk or self.chunk
        for i in range(0, B.shape[1], chunk):
            yield pre.apply(torch.einsum("lnto,lnti->lnoi", B[:, i : i + chunk], A[:, i : i + chunk]))

    def _sketch_linear(self, names: tuple[str, ...], maps: "_LayerMaps", B: torch.Tensor, A: torch.Tensor, state: "_PassState") -> torch.Tensor:
        d_out, d_in, pre = B.shape[-1], A.shape[-1], maps.pre
        if self.sketch == "count":
            cs = self._sketcher(names, CountSketch, d_out, d_in, state.seed, B.device)
            return torch.cat([cs(G) for G in self._materialised(pre, B, A)])
        if not maps.factored:
            return self._formed_sketch(names, maps, B, A, state, utilities=False)[1]
        cls = TensorSketch if self.sketch == "tensor" else TwoSidedProjection
        sketcher = self._sketcher(names, cls, d_out, d_in, state.seed, B.device)
        if hasattr(pre, "token_maps"):  # the token factors' maps folded into the sketch's dense rows
            return sketcher(B, A, *pre.token_maps())
        return sketcher(*pre.token_factors(B, A))

    def _formed_sketch(self, names: tuple[str, ...], maps: "_LayerMaps", B: torch.Tensor, A: torch.Tensor,
                       state: "_PassState", utilities: bool = True) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(utilities [L, N] or None, sketch [N, m]) of an AdamW stack beyond the factor tolerance: the tensor sketch's
        hash on the formed P G_i. Each G_i = Σ_t b_t a_tᵀ is formed once, in chunks that stay in cache, and read
        twice: u_i = ⟨G_i, Q⟩ (where asked), then C·D ⊙ s1(o)s2(i) ⊙ G_i hashed (the map and the hash's signs in
        one pass)."""
        d_out, d_in = B.shape[-1], A.shape[-1]
        weights = maps.pre.apply(self._sketcher(names, TensorSketch, d_out, d_in, state.seed, B.device).signs())
        rows = max(1, MATERIALISED_ELEMENTS // weights[0].numel())
        u, sketches = [], []  # layer by layer (each layer's own sketcher hashes as the stack's does)
        for k, name in enumerate(names):
            layer = self._sketcher((name,), TensorSketch, d_out, d_in, state.seed, B.device)
            for i in range(0, B.shape[1], rows):
                G = torch.einsum("lnto,lnti->nloi", B[k : k + 1, i : i + rows], A[k : k + 1, i : i + rows])
                if utilities:
                    u.append(G.flatten(1) @ maps.Q[k].flatten())
                sketches.append(layer.signed_matrices(G.mul_(weights[k : k + 1])))
        sketch = torch.cat(sketches).view(len(names), B.shape[1], -1).sum(0)
        return (torch.cat(u).view(len(names), B.shape[1]) if utilities else None), sketch

    def _sq_norms(self, pre: Preconditioner, B: torch.Tensor, A: torch.Tensor) -> torch.Tensor:
        """[L, N] ‖P G_i‖² per layer."""
        T, d_out, d_in = B.shape[2], B.shape[-1], A.shape[-1]
        if pre.exact_factors and 2 * T * T <= d_in * d_out:
            b2, a2 = pre.token_factors(B, A)
            return ((a2 @ a2.mT) * (b2 @ b2.mT)).sum((2, 3))
        return torch.cat([G.pow(2).sum((2, 3)) for G in self._materialised(pre, B, A)], 1)

    def _embedding(self, name: str, module: nn.Embedding, ids: torch.Tensor, B: torch.Tensor, state: "_PassState") -> None:
        N, V, d = state.n, module.num_embeddings, B.shape[-1]
        maps = state.maps.get((name,))
        if maps is None:
            gbar = torch.zeros(V, d, device=B.device).index_add_(0, ids[N:].reshape(-1), B[N:].reshape(-1, d))
            gbar /= state.proxy_rows()
            pre = state.resolve([module.weight], gbar[None])
            if not isinstance(pre, (DiagonalMap, ScalarMap)):
                raise TypeError(f"embedding {name!r} is preconditioned by {type(pre).__name__}; only elementwise maps apply")
            maps = state.maps[(name,)] = _LayerMaps(pre, pre.utility_vector(gbar[None])[0])
        if N == 0:
            return
        ids, B, pre = ids[:N], B[:N], maps.pre
        state.utilities[name] = (maps.Q[ids] * B).sum((1, 2))
        rows = self._embedding_rows(pre, ids, B)
        if self.sketch_dim:
            state.add_sketch(self._embedding_sketch(name, ids, rows, V, state))
            if state.probe:
                state.add_probe(torch.cat(list(self._embedding_mats(ids[: state.probe], rows[: state.probe], V)))[None])
        if self.norms:
            state.add_norm(torch.cat([G.pow(2).sum((1, 2)) for G in self._embedding_mats(ids, rows, V)]))

    @staticmethod
    def _embedding_rows(pre: Preconditioner, ids: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
        """b'_t = P's diagonal at row x_t times b_t, [N, T, d]: P G_i = Σ_t e_{x_t} b'_tᵀ for an elementwise P."""
        return pre.C * pre.D[0][ids] * B if isinstance(pre, DiagonalMap) else pre.c * B

    def _embedding_sketch(self, name: str, ids: torch.Tensor, rows: torch.Tensor, vocab: int, state: "_PassState") -> torch.Tensor:
        """[N, m] the sketch of P G_i = Σ_t e_{x_t} b'_tᵀ under the sketcher of layer ``name``."""
        if self.sketch == "tensor":
            return self._sketcher((name,), TensorSketch, vocab, rows.shape[-1], state.seed, rows.device).one_hot(rows, ids)
        if self.sketch == "count":
            cs = self._sketcher((name,), CountSketch, vocab, rows.shape[-1], state.seed, rows.device)
            return torch.cat([cs(G[None]) for G in self._embedding_mats(ids, rows, vocab)])
        raise ValueError("two-sided sketches do not cover embeddings; use sketch='tensor' or 'count'")

    def _embedding_mats(self, ids: torch.Tensor, rows: torch.Tensor, vocab: int):
        """Per-sample P G_i = Σ_t e_{x_t} b'_tᵀ as [chunk, V, d] matrices."""
        for k in range(0, ids.shape[0], self.chunk):
            yield torch.stack(
                [torch.zeros(vocab, rows.shape[-1], device=rows.device).index_add_(0, i, r)
                 for i, r in zip(ids[k : k + self.chunk], rows[k : k + self.chunk])]
            )


@dataclass
class _LayerMaps:
    """What the proxy rows fix for a group of L stacked layers: the map P, the utility vector
    Q = −Jᵀḡ [L, ...], the bias terms, AdamW's factor errors [L] and whether its sketch goes through the factors."""

    pre: Preconditioner
    Q: torch.Tensor
    bias_pre: Preconditioner | None = None
    Q_bias: torch.Tensor | None = None
    factor_error: torch.Tensor | None = None
    relative_factor_error: torch.Tensor | None = None
    factored: bool = True


class _PassState:
    """Captures and accumulators of one forward/backward over n candidate rows then p proxy rows
    (either may be 0); ``maps`` is shared by the passes of one scoring call."""

    def __init__(self, n: int, p: int, resolve: Resolver, seed: int, maps: dict[tuple[str, ...], _LayerMaps]) -> None:
        self.n, self.p, self.resolve, self.seed, self.maps = n, p, resolve, seed, maps
        self.roots: list[torch.Tensor] = []
        self.shared: list[str] = []
        self.inputs: dict[str, torch.Tensor] = {}
        self.out_shapes: dict[str, torch.Size] = {}
        self.grads: dict[str, torch.Tensor] = {}
        self.group_of: dict[str, tuple[str, ...]] = {}
        self.utilities: dict[str, torch.Tensor] = {}
        self.losses: torch.Tensor | None = None
        self.sketch: torch.Tensor | None = None
        self.sq_norms: torch.Tensor | None = None
        self.probe = 0  # candidates whose exact Gram this pass accumulates
        self.probe_gram: torch.Tensor | None = None
        self.factor_errors = True  # whether the pass that fixes the maps reports AdamW's Frobenius factor errors
        self.calls: list[nn.Module] | None = None  # the linear layers' forwards in order, on the engine's first pass
        self.root_call = 0  # the earliest scored layer's place in ``calls``

    def proxy_rows(self) -> int:
        """P of this pass; a layer's map is fixed in the pass that carries the proxy rows."""
        if not self.p:
            raise RuntimeError("ghost scoring: a candidate pass ran before the proxy rows fixed the layer's map")
        return self.p

    def add_sketch(self, s: torch.Tensor) -> None:
        self.sketch = s if self.sketch is None else self.sketch + s

    def add_norm(self, v: torch.Tensor) -> None:
        self.sq_norms = v if self.sq_norms is None else self.sq_norms + v

    def add_probe(self, *pg: torch.Tensor) -> None:
        """Adds Σ ⟨P G_i, P G_j⟩ of the probed candidates' exact P G_i, each [L, k, ...]."""
        for x in pg:
            flat = x.float().transpose(0, 1).flatten(1)
            gram = flat @ flat.T
            self.probe_gram = gram if self.probe_gram is None else self.probe_gram + gram


def _probe_errors(S: torch.Tensor, exact: torch.Tensor) -> dict[str, torch.Tensor]:
    """The sketch's error on k probed candidates: S [k, m] against their exact Gram [k, k] (see ``GhostScores``)."""
    est, k = S.float() @ S.float().T, S.shape[0]
    diag = exact.diagonal()
    iu = torch.triu_indices(k, k, 1, device=S.device)
    rel = (est - exact).abs() / torch.outer(diag, diag).sqrt()
    return {"gram": rel[iu[0], iu[1]].mean(), "sq_norm": (est.diagonal() / diag - 1).mean()}


def _linear_utilities(B: torch.Tensor, A: torch.Tensor, Q: torch.Tensor) -> torch.Tensor:
    """[L, N] u = Σ_t b_tᵀ Q a_t for B [L, N, T, rows], A [L, N, T, cols], Q [L, rows, cols]; the product lands
    on the narrower side (fewer numbers to multiply and sum)."""
    return (rows_matmul(B, Q).mul_(A) if A.shape[-1] <= B.shape[-1] else rows_matmul(A, Q.mT).mul_(B)).sum((2, 3))


def stack_by_default(device: torch.device, resolve: Resolver, param: torch.nn.Parameter) -> bool:
    """Stack same-shaped layers on accelerators (launch-bound). On a CPU, where stacking copies the captures and saves
    no launches, only where the map does many small operations per matrix (``resolve.stacks``: Muon's eigendecomposition
    and scalar recursion, one per stack instead of one per layer)."""
    return device.type != "cpu" or resolve.stacks(param)


def _stack(tensors: list[torch.Tensor]) -> torch.Tensor:
    """[L, ...]; a single tensor is viewed, not copied."""
    return tensors[0].unsqueeze(0) if len(tensors) == 1 else torch.stack(tensors)


def take_rows(rows: MutableMapping, index: torch.Tensor, n_rows: int) -> dict:
    """Rows ``index`` of every per-row tensor of ``rows`` (other values pass through)."""
    return {k: v[index.to(v.device)] if isinstance(v, torch.Tensor) and v.ndim and v.shape[0] == n_rows else v
            for k, v in rows.items()}


def check_precision(trainer) -> None:
    """Refuse fp16 mixed precision with a GradScaler: it would scale the scoring gradients.

    bf16 autocast and fp32 are fine (captured tensors are promoted to fp32 for the contractions).
    """
    if getattr(trainer.precision_plugin, "scaler", None) is not None:
        raise ValueError(
            "ghost scoring does not run under fp16 GradScaler (precision='16-mixed'): the scaler multiplies the "
            "backward and its overflow skipping would corrupt scores; use precision='bf16-mixed' or '32-true'"
        )
