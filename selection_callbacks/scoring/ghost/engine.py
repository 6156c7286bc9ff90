"""The ghost-gradient engine: per-sample gradient geometry from one forward/backward, no per-sample gradients.

One forward over R = N candidate rows ++ P target rows and one backward capture each scored layer's inputs a
and output gradients b (:mod:`~selection_callbacks.scoring.ghost.capture`); no parameter ``.grad`` is read or
written (gradient accumulation and DDP buckets are untouched). Layers are scored inside the backward, as soon
as their output gradients arrive, by the scorer registered for their type
(:mod:`~selection_callbacks.scoring.ghost.scorers`: linear layers, embeddings, a weight tied across several
layers). With ``candidate_chunk`` the target rows ride with the first chunk of candidates (fixing each
layer's P and Q) and the rest follow in chunks of their own, so activation memory does not grow with N. On an
accelerator, layers of one shape and one optimizer group form a layer group, scored together when its
last gradient arrives (one kernel per layer group rather than per layer: a GPU is launch-bound at these sizes); on a
CPU each layer is scored alone (grouping only copies there) unless its map gains from grouping. Per layer:

- target direction ḡ = (1/P) Σ_p G_p and the utility vector Q = −Jᵀḡ of the step's derivative J
  (``OptimizerMap.utility_vector``; Q = P ḡ for the self-adjoint SGD and AdamW maps; Muon's J
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
- optional squared norms ‖P G_i‖², by the T² Gram form where 2T² ≤ d_in·d_out, else formed.
"""

from __future__ import annotations

from collections.abc import Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from selection_callbacks.scoring.ghost import embedding, linear, tied  # noqa: F401  (each registers its scorer)
from selection_callbacks.scoring.ghost.capture import HookCapture
from selection_callbacks.scoring.ghost.layers import linear_kind, registered_parameters, scored_layers, tied_weights
from selection_callbacks.scoring.ghost.scorers import SCORERS, TiedWeight, scorer_for
from selection_callbacks.scoring.ghost.state import FixedMaps, PassState
from selection_callbacks.scoring.maps.base import StepMaps
from selection_callbacks.scoring.sketch import TensorSketch, sketch_blocks

SketchKind = Literal["tensor", "count", "two_sided"]
GROUP_ROW_ELEMENTS = 1 << 20  # numbers of captured a and b per row in one group of layers
FACTOR_TOLERANCE = 0.3  # ρ up to which AdamW groups are sketched through κ r cᵀ


@dataclass
class GhostScores:
    """What one scoring pass returns (candidates only; tensors on the model's device).

    Attributes:
        utilities: [N] Σ_layers ⟨G_i, −Jᵀḡ⟩ (= ⟨P G_i, ḡ⟩ for self-adjoint maps).
        layer_utilities: layer name → [N] (a weight and its bias together; a tied weight under its first layer).
        losses: [R] per-row losses (candidates then target rows).
        sketches: [N, m] or None.
        sq_norms: [N] Σ_layers ‖P G_i‖² or None.
        factor_error: layer name → ‖D − r cᵀ‖_F/‖D‖_F of AdamW's rank-1 factorisation (tensor/two-sided sketches;
            empty when ``score(factor_errors=False)``); not the sketch's error (see ``relative_factor_error``, ``sketch_error``).
        relative_factor_error: layer name → ρ of that factorisation (:attr:`DiagonalMap.relative_factor_error`).
        factored: the AdamW layers whose sketch went through the rank-1 factors (the rest were formed exactly).
        sketch_error: with ``probe`` = k: ``"gram"``, the mean over the k(k−1)/2 pairs of
            |⟨S_i, S_j⟩ − ⟨P G_i, P G_j⟩| / (‖P G_i‖‖P G_j‖), and ``"sq_norm"``, the mean of ‖S_i‖²/‖P G_i‖² − 1
            (signed), over the first k candidates against their formed P G_i (the sketch as used:
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



class GhostEngine:
    """Scores candidates against a target batch with captured ghost gradients.

    Example::

        engine = GhostEngine(pl_module.model, sketch_dim=1024)
        scores = engine.score(pl_module.per_sample_loss, rows, n_candidates=N,
                              step_maps=OptimizerStepMaps(optimizer))

    Args:
        model: the (unwrapped) module whose layers are scored.
        include_embedding: also score ``nn.Embedding`` weights.
        include_head: also score the output head (found by :func:`~selection_callbacks.nn.heads.output_heads`).
            A head tied to the embedding is one weight: either flag scores it, over both uses.
        sketch_dim: m; 0 disables sketches. With ``"tensor"`` each scored layer owns a block of the
            bins in proportion to its weight size (:func:`sketch_blocks`), at least one.
        sketch: ``"tensor"`` (TensorSketch of the token factors; AdamW layers per ``factor_tolerance``), ``"count"``
            (exact CountSketch of formed P G_i, the reference) or ``"two_sided"`` (AdamW through its
            rank-1 factorised D).
        norms: also compute ‖P G_i‖².
        chunk: candidates per chunk where per-sample matrices are formed.
        exclude: module names not to score (e.g. a layer applied twice per forward).
        candidate_chunk: score candidates in forward/backward passes of at most this many rows
            (the target rows ride with the first), so activation memory stays flat in N (None: one
            pass over all rows, the fastest for small N). Rows must not interact (no batch norm).
            Scores equal one pass's.
        group_layers: score same-shaped layers of one optimizer group as one layer group (None: on
            accelerators; on a CPU, where it copies the captures and saves no launches, only the
            layers whose map gains from it, Muon's: :func:`group_by_default`).
        factor_tolerance: with ``"tensor"``, an AdamW group is sketched through its rescaled rank-1 factors where
            its largest ρ (:attr:`DiagonalMap.relative_factor_error`) is at most this (one device sync per group
            and call), else from P G_i formed in ``chunk``-candidate chunks (0: always formed, unbiased;
            ∞: always factored).

    Raises:
        ValueError: an unknown ``sketch``, ``candidate_chunk`` < 1, or a tied layer with a bias.
        TypeError: a layer with a trainable ≥ 2-D parameter and no ghost form (:func:`scored_layers`).
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
        group_layers: bool | None = None,
        factor_tolerance: float = FACTOR_TOLERANCE,
    ) -> None:
        if sketch not in ("tensor", "count", "two_sided"):
            raise ValueError(f"unknown sketch {sketch!r}; choose tensor, count or two_sided")
        self.model = model
        self.layers = scored_layers(model, include_embedding, include_head, tuple(exclude))
        if candidate_chunk is not None and candidate_chunk < 1:
            raise ValueError(f"candidate_chunk must be ≥ 1 or None, got {candidate_chunk}")
        self._tied = {name: names for names in tied_weights(self.layers) for name in names}
        for name, module in self.layers:
            if name in self._tied and getattr(module, "bias", None) is not None:
                raise ValueError(f"layer {name!r} shares its weight with {list(self._tied[name])} and has a bias: "
                                 "tied layers are scored without biases; exclude them")
        # a tied weight once
        owners = [(name, m) for name, m in self.layers if self._tied.get(name, (name,))[0] == name]
        sizes = [module.weight.numel() for _, module in owners]
        self._blocks = dict(zip([name for name, _ in owners], sketch_blocks(sizes, sketch_dim))) if sketch == "tensor" and sketch_dim else {}
        self.sketch_dim, self.sketch, self.norms, self.chunk = sketch_dim, sketch, norms, chunk
        self.candidate_chunk, self.group_layers, self.factor_tolerance = candidate_chunk, group_layers, factor_tolerance
        self._modules = dict(self.layers)
        self._index = {name: i for i, (name, _) in enumerate(self.layers)}
        self._sketchers: dict[tuple, object] = {}
        self._params = registered_parameters(model, self.layers)
        self.capture = HookCapture(model, self.layers)

    @property
    def backward_flops(self) -> int | None:
        """2 · Σ d_in·d_out over the linear layers the scoring backward runs through, per token (None before
        the first pass). The backward starts at the loss and stops at the earliest scored layer's input, so
        with only late layers scored (``exclude``) the layers before them cost no backward."""
        return self.capture.backward_flops

    def module(self, name: str) -> nn.Module:
        """The scored layer ``name``."""
        return self._modules[name]

    def parameter(self, name: str, key: str = "weight") -> nn.Parameter | None:
        """The parameter ``key`` of the scored layer ``name`` as the optimizer holds it (under FSDP2 the sharded
        ``DTensor``, not the unsharded copy the module holds inside a forward and backward; read at the start of
        each :meth:`score`: :func:`~selection_callbacks.scoring.ghost.layers.registered_parameters`); None if the
        layer has no such parameter (no bias)."""
        return self._params[name].get(key)

    def score(
        self,
        loss_fn: Callable[[MutableMapping], torch.Tensor],
        rows: MutableMapping,
        n_candidates: int,
        step_maps: StepMaps,
        seed: int = 0,
        probe: int = 0,
        factor_errors: bool = True,
    ) -> GhostScores:
        """Scores of ``rows`` (candidates first, then ≥ 1 target rows) under the maps ``step_maps``.

        One forward/backward over all rows, or, with ``candidate_chunk`` = c < N, one over the
        first c candidates and the target rows (which fix each layer's P and Q), then one per
        further chunk of c candidates. ``probe`` = k ≥ 2 (with sketches) also forms P G_i of the first
        min(k, c) candidates in every layer and reports the sketch's error on them (``sketch_error``).
        ``factor_errors`` = False leaves out ``GhostScores.factor_error`` (a diagnostic: one pass over each
        AdamW layer's D); ρ, which picks the sketch path, is always computed.

        Raises:
            ValueError: no candidate or no target row.
            RuntimeError: a scored layer's capture did not fire (as under ``torch.compile``), or its output gradient
                never arrived (its output does not reach the loss; :meth:`capture_problems` finds both before scoring).
        """
        n_rows = rows["input_ids"].shape[0]
        if not 0 < n_candidates < n_rows:
            raise ValueError(f"need candidates and ≥ 1 target row: N={n_candidates} of R={n_rows} rows")
        self._params = registered_parameters(self.model, self.layers)
        fixed: dict[tuple[str, ...], FixedMaps] = {}
        c = min(self.candidate_chunk or n_candidates, n_candidates)
        first = rows if c == n_candidates else take_rows(rows, torch.cat([torch.arange(c), torch.arange(n_candidates, n_rows)]), n_rows)
        head = PassState(c, n_rows - n_candidates, step_maps, seed, fixed)
        head.factor_errors = factor_errors
        head.probe = min(probe, c) if self.sketch_dim and probe >= 2 else 0
        passes = [self._pass(loss_fn, first, head)]
        for lo in range(c, n_candidates, c):
            hi = min(lo + c, n_candidates)
            state = PassState(hi - lo, 0, step_maps, seed, fixed)
            state.shared = list(passes[0].shared)  # a pass of one row cannot tell a broadcast table from a per-row one
            passes.append(self._pass(loss_fn, take_rows(rows, torch.arange(lo, hi), n_rows), state))
        return self._collect(passes, fixed, c)

    def _collect(self, passes: list[PassState], fixed: dict[tuple[str, ...], FixedMaps], c: int) -> GhostScores:
        """The scoring call's :class:`GhostScores` from its passes (the first carries c candidates and the target
        rows)."""
        head = passes[0]
        losses = torch.cat([head.losses[:c], *(s.losses for s in passes[1:]), head.losses[c:]])
        order = [name for name, _ in self.layers if name in head.utilities]
        layer_utilities = {name: torch.cat([s.utilities[name] for s in passes]) for name in order}
        sketches = [s.sketch for s in passes if s.sketch is not None]
        norms = [s.sq_norms for s in passes if s.sq_norms is not None]
        def per_layer(key):
            return {name: getattr(m, key)[i] for names, m in fixed.items() if getattr(m, key) is not None
                    for i, name in enumerate(names)}
        return GhostScores(
            utilities=torch.stack(list(layer_utilities.values())).sum(0),
            layer_utilities=layer_utilities,
            losses=losses,
            sketches=torch.cat(sketches) if sketches else None,
            sq_norms=torch.cat(norms) if norms else None,
            factor_error=per_layer("factor_error"),
            relative_factor_error=per_layer("relative_factor_error"),
            factored=sorted((name for names, m in fixed.items() if m.relative_factor_error is not None and m.factored for name in names),
                            key=self._index.__getitem__),
            sketch_error=_probe_errors(sketches[0][: head.probe], head.probe_gram) if head.probe else {},
            shared=head.shared,
        )

    def _pass(self, loss_fn: Callable[[MutableMapping], torch.Tensor], rows: MutableMapping, state: PassState) -> PassState:
        """One forward/backward over ``rows`` through the capture, scoring inside it; fills ``state``."""

        def ready() -> None:  # after the forward: the captured layers' groups
            for names in self._groups(state):
                state.group_of.update((name, names) for name in names)

        def arrived(name: str, grad: torch.Tensor) -> None:
            received.add(name)
            self._arrived(name, grad, state)

        received: set[str] = set()
        losses = self.capture.run(loss_fn, rows, state, ready, arrived)
        missing = [name for name, _ in self.layers if name not in state.utilities and name not in state.shared
                   and self._tied.get(name, (name,))[0] == name]  # a tied weight's utilities are its first layer's
        if missing:  # every pass carries ≥ 1 candidate, so a scored layer has utilities
            unreached = [name for name in state.out_shapes if name not in received]
            if unreached:
                raise RuntimeError(_unreached_message(unreached))
            raise RuntimeError(
                f"ghost capture scored {len(state.utilities)} of {len(self.layers)} layers (missing e.g. {missing[:3]}): hooks "
                "did not fire, as under torch.compile; score the eager module instead of returning partial scores"
            )
        state.losses = losses.detach()
        return state

    def capture_problems(self, loss_fn: Callable[[MutableMapping], torch.Tensor], rows: MutableMapping) -> list[str]:
        """What keeps the capture from scoring every layer of this wiring, each with its fix ([] when nothing does).

        Runs one forward/backward of ``loss_fn`` over ``rows`` through the capture, scoring nothing (so the
        capture's first pass, which finds the backward's roots, is this one): a scored layer that did not run
        in the forward (or ran with gradients off) is never captured; one that ran but whose output does not
        reach the loss never receives its output gradient. Run it on the eager module (a compiled graph fires
        no hooks). Errors the capture raises on the layers themselves (a module applied twice, an input without
        the row dimension, a table whose forward is not a scaled lookup) propagate.
        """
        state = PassState(rows["input_ids"].shape[0], 0, None, 0, {})  # type: ignore[arg-type]  (nothing is scored)
        received: set[str] = set()
        self.capture.run(loss_fn, rows, state, lambda: None, lambda name, grad: received.add(name))
        unrun = [name for name, _ in self.layers if name not in state.out_shapes and name not in state.shared]
        unreached = [name for name in state.out_shapes if name not in received]
        problems = []
        if unrun:
            problems.append(
                f"ghost scoring: {len(unrun)} scored layer(s) did not run in the per-sample loss's forward, or ran where "
                f"autograd records nothing (under no_grad, or frozen weights on inputs that need no gradient): "
                f"{_shown(unrun)}; their per-sample gradients cannot be captured. {_LEAVE_OUT}"
            )
        if unreached:
            problems.append(_unreached_message(unreached))
        return problems

    def _arrived(self, name: str, grad: torch.Tensor, state: PassState) -> None:
        """Keep b; once every layer of its group has its b, score the group (in float32)."""
        state.grads[name] = grad
        names = state.group_of[name]
        if all(n in state.grads for n in names):
            with torch.no_grad(), torch.autocast(grad.device.type, enabled=False):
                self._score_group(names, state)

    def _score_group(self, names: tuple[str, ...], state: PassState) -> None:
        """The group ``names`` scored by its type's registered scorer (a tied weight's by :class:`TiedWeight`'s)."""
        scorer = SCORERS[TiedWeight] if names[0] in self._tied else scorer_for(self._modules[names[0]])
        scorer(self, names, state)

    def _groups(self, state: PassState) -> list[tuple[str, ...]]:
        """Captured layers in layer groups (after the forward, before the backward): same weight
        and bias shapes, optimizer groups and captured shapes, split so that one group holds at most
        ``GROUP_ROW_ELEMENTS`` numbers per row (the split depends on per-row sizes only, so every pass
        of a scoring call groups alike). A layer that joins no group (``group_layers``) is its own group.

        Embeddings stay alone (their sketch and norm paths are per table); the layers sharing one weight
        form one group of their own (:mod:`~selection_callbacks.scoring.ghost.tied`).
        """
        groups: dict[tuple, list[str]] = {}
        for name, module in self.layers:
            if name not in state.inputs:
                continue
            if name in self._tied:  # one weight, one group of its uses
                key: tuple = self._tied[name]
            elif isinstance(module, nn.Embedding) or not self._joins_group(self.parameter(name), state.step_maps):
                key = (name,)
            else:
                weight, bias = self.parameter(name), self.parameter(name, "bias")
                key = (linear_kind(module), weight.shape, state.step_maps.group_key(weight), bias is None,
                       None if bias is None else state.step_maps.group_key(bias),
                       state.inputs[name].shape[1:], state.out_shapes[name][1:])
            groups.setdefault(key, []).append(name)
        out: list[tuple[str, ...]] = []
        for names in groups.values():
            members: list[str] = []
            for name in names:
                per_row = (state.inputs[name][0].numel() + state.out_shapes[name][1:].numel()) * (len(members) + 1)
                if members and per_row > GROUP_ROW_ELEMENTS and name not in self._tied:
                    out.append(tuple(members))
                    members = []
                members.append(name)
            out.append(tuple(members))
        return out


    def _joins_group(self, weight: torch.Tensor, step_maps: StepMaps) -> bool:
        """Whether ``weight``'s layer joins a group. A sharded (FSDP2) weight never does: its map gathers its layer's
        optimizer state whole, and alone it holds one layer's gathered state at a time."""
        if isinstance(weight, DTensor):
            return False
        if self.group_layers is not None:
            return self.group_layers
        return group_by_default(weight.device, step_maps, weight)

    def sketcher(self, names: tuple[str, ...], cls: type, d_out: int, d_in: int, seed: int, device: torch.device):
        """The sketch of layers ``names`` (a bias is ``<layer>.bias``), hashed by (seed, layer index)."""
        key = (names, cls.__name__, seed)
        if key not in self._sketchers:
            layers = [self._index[n] if n in self._index else len(self._index) + self._index[n.rsplit(".", 1)[0]] for n in names]
            self._sketchers = {k: v for k, v in self._sketchers.items() if k[2] == seed}
            blocks = {"block": self._blocks[names[0]][1], "offsets": [self._blocks[n][0] for n in names]} if cls is TensorSketch else {}
            self._sketchers[key] = cls(self.sketch_dim, d_out, d_in, seed, layers, device, **blocks)
        return self._sketchers[key]


_LEAVE_OUT = ("Leave them out of the scored layers: layers=[...] (OPUS/GREATS: glob patterns of the layers to score, "
              "which must not match them) or exclude=(...) (GhostEngine)")


def _shown(names: list[str]) -> str:
    return str(names[:4])[:-1] + (", …]" if len(names) > 4 else "]")


def _unreached_message(names: list[str]) -> str:
    return (f"ghost scoring: {len(names)} scored layer(s) ran in the forward but their output gradients never arrived: "
            f"{_shown(names)}; their outputs do not reach the per-sample loss (unused, or detached from it), so "
            f"the loss has no gradient in their weights to score. {_LEAVE_OUT}")


def _probe_errors(S: torch.Tensor, exact: torch.Tensor) -> dict[str, torch.Tensor]:
    """The sketch's error on k probed candidates: S [k, m] against their exact Gram [k, k] (see ``GhostScores``)."""
    est, k = S.float() @ S.float().T, S.shape[0]
    diag = exact.diagonal()
    iu = torch.triu_indices(k, k, 1, device=S.device)
    rel = (est - exact).abs() / torch.outer(diag, diag).sqrt()
    return {"gram": rel[iu[0], iu[1]].mean(), "sq_norm": (est.diagonal() / diag - 1).mean()}


def group_by_default(device: torch.device, step_maps: StepMaps, param: torch.nn.Parameter) -> bool:
    """Group same-shaped layers on accelerators (launch-bound). On a CPU, where grouping copies the captures and saves
    no launches, only where the map does many small operations per matrix (``step_maps.gains_from_grouping``: Muon's
    eigendecomposition and scalar recursion, one per group instead of one per layer)."""
    return device.type != "cpu" or step_maps.gains_from_grouping(param)


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
