"""Running a compiled module's eager forward for one scoring pass, the compiled one staying for training.

The ghost capture (:mod:`~selection_callbacks.scoring.ghost.capture`) reads each scored layer's input and output
gradient through module and tensor hooks, which do not fire per layer inside a compiled graph. :func:`eager`
makes every compiled module under a root run its eager forward while the context is open and restores the
compiled one on exit, so the training step stays compiled and the compiled code is neither retraced nor
invalidated (the compiled callables are kept as they are, only not called). Three ways a module runs compiled:

- ``Module.compile()``: the instance's ``_compiled_call_impl`` is set; cleared, ``__call__`` runs ``_call_impl``;
- ``torch.compile(module)``: an ``OptimizedModule`` whose ``forward`` is the compiled call of ``_orig_mod``;
  it calls ``_orig_mod`` directly instead;
- a Lightning module compiled by ``trainer.fit(torch.compile(pl_module))``: its ``forward`` is the compiled
  one and ``_compiler_ctx["original_forward"]`` the eager one, which it calls instead.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch.nn as nn
from torch._dynamo.eval_frame import OptimizedModule

__all__ = ["compiled_modules", "eager"]


def _eager_attributes(module: nn.Module) -> dict[str, Any]:
    """The instance attributes that make ``module`` itself run eager, with their eager values ({} when it does)."""
    own = vars(module)
    if own.get("_compiled_call_impl") is not None:
        return {"_compiled_call_impl": None}
    if isinstance(module, OptimizedModule):
        return {"forward": module._orig_mod.__call__}
    ctx = own.get("_compiler_ctx")
    if isinstance(ctx, dict) and "original_forward" in ctx:
        return {"forward": ctx["original_forward"]}
    return {}


def compiled_modules(root: nn.Module) -> list[str]:
    """Names of the modules under ``root`` (``""``: root itself) that run compiled, in ``named_modules`` order.

    Example::

        model.blocks[0].compile()
        compiled_modules(model)  # ['blocks.0']
    """
    return [name for name, module in root.named_modules() if _eager_attributes(module)]


@contextmanager
def eager(root: nn.Module) -> Iterator[list[str]]:
    """Every compiled module under ``root`` runs its eager forward inside the context; the compiled ones come back on exit.

    The eager forward computes what the compiled one does (up to the compiler's floating-point reordering) with
    the same parameters; module hooks fire in it per layer. Gradients of tensors made inside the context flow
    through eager autograd nodes whenever the backward runs. Yields the names of the modules that run eager.

    Example::

        with eager(pl_module) as names:
            losses = pl_module.per_sample_loss(batch)  # the capture's hooks fire in every layer
    """
    saved: list[tuple[nn.Module, str, Any]] = []
    names = []
    try:
        for name, module in root.named_modules():
            swap = _eager_attributes(module)
            if swap:
                names.append(name)
            for attribute, value in swap.items():
                saved.append((module, attribute, vars(module).get(attribute)))
                vars(module)[attribute] = value
        yield names
    finally:
        for module, attribute, value in reversed(saved):
            vars(module)[attribute] = value
