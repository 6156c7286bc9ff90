"""What an optimizer map is, and the registry of the maps of torch's optimizers.

Write the step torch takes on a fresh gradient g as Δθ(g). A candidate's utility is the first-order
decrease of the target loss its gradient causes through that step, u_i = −⟨J G_i, ḡ⟩ = ⟨G_i, −Jᵀḡ⟩ with
J = ∂Δθ/∂g at the map's stated evaluation point: ``utility_vector(ḡ)`` = −Jᵀḡ. The redundancy
sketches use a frozen map P (Δθ ≈ −P g with the optimizer's state held fixed) through ``apply`` and
``token_factors``; for SGD and AdamW P = −J (diagonal, self-adjoint); for Muon P is Newton–Schulz
frozen at the momentum, and ``utility_vector`` is the exact vector–Jacobian product of the
iteration instead. ``token_factors`` maps one rank-1 token term b aᵀ to
P(b aᵀ) = b' a'ᵀ (exact for scalar and Muon maps; for AdamW only after the rank-1
factorisation D ≈ r cᵀ, whose errors ``factor_error`` and ``relative_factor_error`` report; the engine
sketches an AdamW layer through these factors only where the relative one is within its tolerance, and
otherwise forms P G_i exactly).

A map covers a group of L parameters of one shape (the engine scores same-shaped layers together, so
a GPU sees one kernel per group instead of one per layer): its tensors carry a leading layer
dimension, and every method takes tensors [L, ..., *shape] with any number of middle dimensions.

An optimizer class's map builder, ``builder(optimizer, group, params, gbar) -> OptimizerMap``, is
registered with :func:`register_map` (``sgd``, ``adamw`` and ``muon`` register torch's); :class:`StepMaps`
is what the engine asks for the map of each group of parameters.

Under FSDP2 a parameter is a ``DTensor`` row shard of the global weight (its ``shape`` global) and so is its
optimizer state; a builder reads each state tensor through :func:`whole`, which all-gathers a ``DTensor`` into the
global tensor (the engine maps sharded layers one at a time, so a rank holds one layer's gathered state at
once) and passes any other tensor through untouched.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Protocol

import torch
from torch.distributed.tensor import DTensor

Scale = float | torch.Tensor  # a Python number for all L layers, or a [L] tensor


class OptimizerMap(Protocol):
    """One optimizer step linearised in the fresh gradient, for a group of L same-shaped parameters."""

    exact_factors: bool

    def apply(self, g: torch.Tensor) -> torch.Tensor:
        """P g for gradients [L, ..., *shape]."""
        ...

    def utility_vector(self, gbar: torch.Tensor) -> torch.Tensor:
        """−Jᵀ ḡ [L, *shape] for target gradients ``gbar`` [L, *shape]: u_i = ⟨G_i, −Jᵀḡ⟩."""
        ...

    def token_factors(self, b: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(b', a') with P(b aᵀ) = b' a'ᵀ per token; b [L, ..., d_out], a [L, ..., d_in]."""
        ...


class StepMaps(Protocol):
    """The maps of one step: gives grouped parameters of one shape (and one ``group_key``) their map."""

    def group_key(self, param: torch.nn.Parameter) -> Hashable:
        """Parameters may share one grouped map only if their keys are equal."""
        ...

    def gains_from_grouping(self, param: torch.nn.Parameter) -> bool:
        """Whether same-shaped parameters of this one's group gain from one grouped map where grouping saves no
        kernel launches (a CPU): maps that do many small operations per matrix."""
        ...

    def __call__(self, params: Sequence[torch.nn.Parameter], gbar: torch.Tensor) -> OptimizerMap:
        """The map of ``params`` (``gbar`` [L, *shape], the target gradients, stand in for missing state)."""
        ...


MapBuilder = Callable[[torch.optim.Optimizer, dict, Sequence[torch.nn.Parameter], torch.Tensor], OptimizerMap]
MAP_BUILDERS: dict[type, MapBuilder] = {}  # optimizer class → the builder of its grouped maps


def register_map(optimizer: type) -> Callable[[MapBuilder], MapBuilder]:
    """Registers the decorated ``builder(optimizer, group, params, gbar)`` as the map of ``optimizer``'s exact class.

    Example::

        @register_map(torch.optim.SGD)
        def sgd_map(opt, group, params, gbar) -> ScalarMap: ...
    """

    def register(builder: MapBuilder) -> MapBuilder:
        MAP_BUILDERS[optimizer] = builder
        return builder

    return register


def whole(state: torch.Tensor) -> torch.Tensor:
    """An optimizer state tensor whole: a ``DTensor`` (the state of an FSDP2-sharded parameter) all-gathered with
    ``full_tensor()`` into the global tensor [*shape], any other tensor itself (no copy, no operation).

    The gather is a collective: every rank of the mesh reads the same states in the same order (the ghost engine
    maps the same layers in the same order on every rank).

    Example::

        v = whole(optimizer.state[p]["exp_avg_sq"])  # [*p.shape] under FSDP2, DDP and one process alike
    """
    return state.full_tensor() if isinstance(state, DTensor) else state


def lead(x: Scale, ndim: int) -> Scale:
    """A per-layer tensor [L, *rest] viewed as [L, 1, ..., 1, *rest] with ``ndim`` dims (numbers pass)."""
    if not isinstance(x, torch.Tensor) or x.ndim == 0:
        return x
    return x.reshape(x.shape[0], *([1] * (ndim - x.ndim)), *x.shape[1:])


def rows_matmul(x: torch.Tensor, M: torch.Tensor) -> torch.Tensor:
    """x [L, ..., k] @ M [L, k, j] → [L, ..., j] as one batched product over the flattened rows.

    A broadcasting ``x @ M[:, None]`` would make ``matmul`` form a copy of M per middle index.
    """
    return (x.reshape(x.shape[0], -1, x.shape[-1]) @ M).reshape(*x.shape[:-1], M.shape[-1])


def per_layer(values: Sequence[float], device: torch.device) -> Scale:
    """One Python number when the layers agree (no host→device copy, no sync), else a [L] tensor."""
    if all(v == values[0] for v in values):
        return float(values[0])
    return torch.tensor(values, dtype=torch.float32, device=device)


def check_minimizes(group: dict, optimizer: str) -> None:
    """Raise ``ValueError`` for a parameter group that maximizes: the maps model a descent step."""
    if group.get("maximize", False):
        raise ValueError(f"{optimizer} with maximize=True is not supported by the optimizer maps")
