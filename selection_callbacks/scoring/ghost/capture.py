"""How a scoring pass obtains each scored layer's input and output gradient.

The engine needs, per scored layer and per row, the layer's input a (or the token ids of an embedding) and
the gradient b = ∂ℓ_r/∂y of the row's loss with respect to the layer's output, delivered as soon as it
exists in the backward so the layer is scored and its captures released while the backward goes on.
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
from selection_callbacks.scoring.ghost.state import PassState

Arrived = Callable[[str, torch.Tensor], None]  # (layer name, output gradient [R, ..., d_out])


class Capture(Protocol):
    """One forward/backward of a loss over rows, capturing the scored layers.

    During the forward, ``run`` fills ``state.inputs`` (name → the layer's input [R, ...], detached),
    ``state.out_shapes`` and ``state.shared`` (layers whose output has no row dimension: not scored); between
    the forward and the backward it calls ``ready()``; during the backward ``arrived(name, grad)`` with each
    scored layer's output gradient. It returns the per-row losses [R] and never reads or writes a
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

    roots: list[torch.Tensor] = field(default_factory=list)
    calls: list[nn.Module] | None = None
    root_call: int = 0  # the earliest scored layer's place in ``calls``
    done: bool = False  # the loss exists: a layer that runs now is the backward recomputing it (checkpointing)


class HookCapture:
    """:class:`Capture` by hooks on the eager module: a forward hook on every scored layer keeps its input and puts a
    tensor hook on its output; one ``torch.autograd.grad`` of Σ_r ℓ_r with respect to the earliest captured
    activations (the first float input, plus the outputs of layers fed by ids) fires the tensor hooks.

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

    @property
    def backward_flops(self) -> int | None:
        """Counted from the first pass's forward order (a layer applied twice counts twice): the backward starts at
        the loss and stops at the earliest scored layer's input."""
        return self._backward_flops

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
                if not forward.roots:
                    raise RuntimeError("ghost capture: no scored layer ran with gradients enabled")
                ready()
                if forward.calls is not None:
                    self._backward_flops = linear_flops_per_token(forward.calls[forward.root_call :])
                torch.autograd.grad(losses.sum(), forward.roots, allow_unused=True)
                forward.roots.clear()  # the pass's states outlive it; its activations need not
        finally:
            for h in handles:
                h.remove()
        return losses

    @staticmethod
    def _hook(name: str, state: PassState, forward: _Forward, arrived: Arrived) -> Callable:
        def hook(module: nn.Module, args: tuple, kwargs: dict, output: torch.Tensor) -> None:
            if forward.done or not torch.is_grad_enabled() or not output.requires_grad:
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
            if not forward.roots and forward.calls is not None:  # the backward reaches this layer and every later one
                forward.root_call = len(forward.calls) - (linear_kind(module) is not None)
            if not (x.is_floating_point() and x.requires_grad):
                forward.roots.append(output)  # a branch that starts here (token ids, raw features)
            elif not forward.roots:
                forward.roots.append(x)  # the earliest activation: the backward to it reaches every later layer
            state.inputs[name] = x.detach()
            state.out_shapes[name] = output.shape
            output.register_hook(lambda grad: arrived(name, grad))

        return hook
