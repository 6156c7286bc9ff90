"""How a scoring pass obtains each scored layer's input and output gradient.

The engine needs, per scored layer and per row, the layer's input a (or the token ids of an embedding) and
the gradient b = ∂ℓ_r/∂y of the row's loss with respect to the layer's output (for an embedding table, with
respect to the rows it looked up: :func:`table_row_gradient`), delivered as soon as it exists in the backward
so the layer is scored and its captures released while the backward goes on.
:class:`Capture` is that contract; :class:`HookCapture` meets it with module forward hooks and tensor hooks
on the eager module. Another capture (one that survives ``torch.compile``, say) meets the same contract.
"""

from __future__ import annotations

from collections.abc import Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn as nn

from selection_callbacks.nn.flops import linear_flops_per_token
from selection_callbacks.scoring.ghost.layers import linear_kind
from selection_callbacks.scoring.ghost.roots import Roots
from selection_callbacks.scoring.ghost.state import PassState

Arrived = Callable[[str, torch.Tensor], None]  # (layer name, output gradient [R, ..., d_out])


class Capture(Protocol):
    """One forward/backward of a loss over rows, capturing the scored layers.

    During the forward, ``run`` fills ``state.inputs`` (name → the layer's input [R, ...], detached),
    ``state.out_shapes`` and ``state.shared`` (layers whose output has no row dimension: not scored); between
    the forward and the backward it calls ``ready()``; during the backward ``arrived(name, grad)`` with each
    scored layer's output gradient (an embedding table's at the rows it looked up). It returns the per-row losses [R] and never reads or writes a
    parameter's ``.grad``.
    """

    @property
    def backward_flops(self) -> int | None:
        """2 · Σ d_in·d_out over the linear layers the scoring backward runs through, per token (None before
        the first pass)."""
        ...

    def run(self, loss_fn: Callable[[MutableMapping], torch.Tensor], rows: MutableMapping, state: PassState,
            ready: Callable[[], None], arrived: Arrived) -> torch.Tensor:
        ...


@dataclass
class _Forward:
    """One forward's hook state: the backward's roots, and the linear layers' calls in order (first pass only)."""

    roots: Roots = field(default_factory=Roots)
    root_inputs: list[str] = field(default_factory=list)  # the layers whose input is a root
    calls: list[nn.Module] | None = None
    root_call: int = 0  # the earliest scored layer's place in ``calls``
    done: bool = False  # the loss exists: a layer that runs now is the backward recomputing it (checkpointing)


class HookCapture:
    """:class:`Capture` by hooks on the eager module: a forward hook on every scored layer keeps its input and puts a
    tensor hook on its output; one ``torch.autograd.grad`` of Σ_r ℓ_r with respect to the roots fires the tensor
    hooks (:mod:`~selection_callbacks.scoring.ghost.roots`): the first scored layer's float input, the input of
    every later scored layer that no earlier root reaches (a parallel-residual block's MLP), and the outputs of
    layers fed by ids. The first pass finds the roots by walking the autograd graph; later passes (the same
    wiring) take the inputs of the same layers.

    Under activation checkpointing (non-reentrant ``torch.utils.checkpoint``) the backward recomputes each
    checkpointed block's forward, which runs the layers' forward hooks again; those calls come after the loss
    and are ignored: the tensor hooks sit on the first forward's outputs, which are the autograd graph's nodes, so
    every output gradient arrives once, and the blocks' other activations are still recomputed, not kept.

    Args:
        model: the module the layers belong to.
        layers: (name, module) of the scored layers.
    """

    def __init__(self, model: nn.Module, layers: list[tuple[str, nn.Module]]) -> None:
        self.model, self.layers = model, layers
        self._backward_flops: int | None = None
        self._root_inputs: set[str] | None = None  # the layers whose float input is a root (found by the first pass)
        self._row_scales: dict[str, torch.Tensor] = {}  # a table whose forward scales the looked-up rows: the scale

    @property
    def backward_flops(self) -> int | None:
        """Counted from the first pass's forward order (a layer applied twice counts twice): the backward starts at
        the loss and stops at the earliest scored layer's input."""
        return self._backward_flops

    @property
    def root_inputs(self) -> set[str] | None:
        """The scored layers whose input is a root of the scoring backward, as the first pass found them (None before
        it): the first scored layer's, and each parallel branch's."""
        return None if self._root_inputs is None else set(self._root_inputs)

    def run(self, loss_fn: Callable[[MutableMapping], torch.Tensor], rows: MutableMapping, state: PassState,
            ready: Callable[[], None], arrived: Arrived) -> torch.Tensor:
        forward = _Forward(calls=[] if self._backward_flops is None else None)
        handles = [m.register_forward_hook(self._hook(name, state, forward, arrived), with_kwargs=True) for name, m in self.layers]
        if forward.calls is not None:  # every linear layer's forward, in order, once
            handles += [m.register_forward_pre_hook(lambda module, args: forward.calls.append(module))
                        for m in self.model.modules() if linear_kind(m) is not None]
        try:
            with torch.enable_grad():
                losses = loss_fn(rows)
                forward.done = True
                if not forward.roots.tensors:
                    raise RuntimeError("ghost capture: no scored layer ran with gradients enabled")
                ready()
                if forward.calls is not None:
                    self._backward_flops = linear_flops_per_token(forward.calls[forward.root_call :])
                torch.autograd.grad(losses.sum(), forward.roots.tensors, allow_unused=True)
                forward.roots.clear()  # the pass's states outlive it; its activations and graph need not
        finally:
            for h in handles:
                h.remove()
        if self._root_inputs is None:
            self._root_inputs = set(forward.root_inputs)
        return losses

    def _hook(self, name: str, state: PassState, forward: _Forward, arrived: Arrived) -> Callable:
        def hook(module: nn.Module, args: tuple, kwargs: dict, output: torch.Tensor) -> None:
            if forward.done or not torch.is_grad_enabled() or not output.requires_grad:
                return
            if name in state.inputs:
                raise RuntimeError(
                    f"ghost scoring: layer {name!r} ran twice in one forward (one module applied twice); its per-sample "
                    "gradient would mix both calls: pass exclude=[...] to score the other layers"
                )
            if name not in state.shared:
                self._capture(name, module, args[0] if args else next(iter(kwargs.values())), output, state, forward, arrived)

        return hook

    def _capture(self, name: str, module: nn.Module, x: torch.Tensor, output: torch.Tensor, state: PassState,
                 forward: _Forward, arrived: Arrived) -> None:
        """Keep layer ``name``'s input, make it (or the output) a root where no earlier root reaches it, and hook
        the output's gradient."""
        rows = state.n + state.p
        if isinstance(module, nn.Embedding) and (x.ndim == 1 or x.shape[0] == 1 < rows):  # a position table, broadcast over rows
            state.shared.append(name)
            return
        if x.ndim < 2 or x.shape[0] != rows:
            raise ValueError(
                f"ghost scoring: layer {name!r} got input of shape {tuple(x.shape)}; scored layers need "
                f"batch-first inputs [R={rows}, ...] (exclude the layer or keep the row dimension)"
            )
        if not forward.roots.tensors and forward.calls is not None:  # the backward reaches this layer and every later one
            forward.root_call = len(forward.calls) - (linear_kind(module) is not None)
        if not (x.is_floating_point() and x.requires_grad):
            forward.roots.add(output)  # a branch that starts here (token ids, raw features)
        elif self._input_is_root(name, x, forward.roots):
            forward.roots.add(x)  # no earlier root reaches this layer (the first; a parallel branch)
            forward.root_inputs.append(name)
        state.inputs[name] = x.detach()
        state.out_shapes[name] = output.shape
        if isinstance(module, nn.Embedding) and name not in self._row_scales:
            self._row_scales[name] = table_row_scale(name, module, x, output)
        scale = self._row_scales.get(name)
        if scale is None and getattr(module, "padding_idx", None) is None:
            output.register_hook(lambda grad: arrived(name, grad))
        else:
            output.register_hook(lambda grad: arrived(name, table_row_gradient(module, x, grad, scale)))

    def _input_is_root(self, name: str, x: torch.Tensor, roots: Roots) -> bool:
        """Whether layer ``name``'s float input ``x`` must be a root: no earlier root reaches it (the first pass walks
        the graph; later passes, of the same wiring, take the layers it found)."""
        if self._root_inputs is not None:
            return name in self._root_inputs
        return not roots.reaches(x)


def table_row_scale(name: str, module: nn.Embedding, ids: torch.Tensor, output: torch.Tensor) -> torch.Tensor | None:
    """The scalar c with ``module(ids)`` = c · W[ids]: None (c = 1) for ``nn.Embedding`` itself, measured on this
    call for a subclass whose forward scales the looked-up rows (Gemma's ``…ScaledWordEmbedding``: c = √d).

    Raises:
        TypeError: the subclass's forward is not a scaled lookup of the table's rows.
    """
    if type(module).forward is nn.Embedding.forward:
        return None
    with torch.no_grad():
        looked_up = nn.functional.embedding(ids, module.weight).float()
        out = output.detach().float()
        if out.shape == looked_up.shape:
            scale = (out * looked_up).sum() / looked_up.pow(2).sum().clamp_min(torch.finfo(torch.float32).tiny)
            if torch.allclose(out, scale * looked_up, rtol=1e-2, atol=1e-6 * float(out.abs().max())):
                return scale
    raise TypeError(
        f"ghost scoring: embedding {name!r} ({type(module).__name__}) overrides nn.Embedding.forward with more than a "
        "scale of the looked-up rows, so its weight's per-sample gradient has no ghost form: score without it "
        "(include_embedding=False, and include_head=False when the head shares its weight) or leave it out with "
        "layers=[...] (OPUS/GREATS) or exclude=(...) (GhostEngine)"
    )


def table_row_gradient(module: nn.Embedding, ids: torch.Tensor, grad: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """The gradient at the rows W[ids] a table looked up, from its output gradient ``grad``: times the forward's
    scale c (:func:`table_row_scale`; None: 1), and zero where ``ids`` is the table's ``padding_idx`` (that row takes
    no gradient)."""
    if scale is not None:
        grad = grad * scale.to(grad.dtype)
    if module.padding_idx is not None:
        grad = grad * (ids != module.padding_idx).unsqueeze(-1).to(grad.dtype)
    return grad
