"""Which training stack a fit runs (compiled learner, FSDP2, activation checkpointing) and which a method serves.

A selection method declares what it serves in its ``supported_stack`` class attribute (a :class:`Stack`);
:meth:`SelectionCallback.on_fit_start` compares it with :func:`fit_stack` of the fit and refuses, before
the first step, what the method does not serve (:func:`stack_problems`). Precision is not part of the
declaration: every method scores under the trainer's precision context (fp32 or bf16-mixed).

What is read from the fit:

- compiled: a learner module compiled in place (``Module.compile()``), an ``OptimizedModule`` inside it, or a
  LightningModule handed to ``trainer.fit`` after ``torch.compile``
  (:func:`~selection_callbacks.scoring.ghost.eager.compiled_modules`, the modules the ghost methods score eager).
- sharded: parameters that are ``DTensor`` (FSDP2's ``fully_shard``) under Lightning's ``ModelParallelStrategy``.
- checkpointed: a block checkpointed by :func:`~selection_callbacks.nn.checkpointing.checkpoint_activations`
  (what a learner applies with :func:`~selection_callbacks.nn.checkpointing.checkpoint_activations`) or wrapped in torch's ``CheckpointWrapper``.
- the strategy: one device, DDP and FSDP2 (``ModelParallelStrategy`` with one data-parallel mesh
  dimension) are the ones selection is defined on; DeepSpeed, FSDP1, tensor parallelism and any other
  strategy are refused for every method (the selection gathers and subsets whole rows per rank, which
  those strategies do not keep).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch.nn as nn
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, ModelParallelStrategy, SingleDeviceStrategy
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.distributed.tensor import DTensor

from selection_callbacks.nn.checkpointing import is_checkpointed
from selection_callbacks.scoring.ghost.eager import compiled_modules

__all__ = ["Stack", "fit_stack", "stack_problems"]

_SERVED_STRATEGIES = (SingleDeviceStrategy, DDPStrategy, ModelParallelStrategy)


@dataclass(frozen=True)
class Stack:
    """A training stack: a fit's, or what a method serves (each True: served; False: refused).

    Example::

        class MyLossSelection(SelectionCallback):
            supported_stack = Stack(compiled=True, sharded=True, checkpointed=True)

    Attributes:
        compiled: the learner runs under ``torch.compile``.
        sharded: the learner's parameters are FSDP2 shards (``DTensor``) under ``ModelParallelStrategy``.
        checkpointed: the learner recomputes block activations in the backward (activation checkpointing).
        reason: why the refused parts are refused (the refusal quotes it).
    """

    compiled: bool = False
    sharded: bool = False
    checkpointed: bool = False
    reason: str = field(compare=False, repr=False, default=(
        "a method serves the stacks it declares in supported_stack; the default serves the eager learner only, "
        "because a method that reads the learner's layers (module hooks, parameters, optimizer state) must say how "
        "it does so inside a compiled graph, on DTensor shards and on recomputed activations, as the shipped "
        "methods do"
    ))


# each part of a stack, as the refusals name it
_WHAT = {
    "compiled": "a compiled learner (torch.compile)",
    "sharded": "FSDP2 (DTensor parameter shards under ModelParallelStrategy)",
    "checkpointed": "activation checkpointing",
}


def fit_stack(pl_module: nn.Module) -> Stack:
    """The stack ``pl_module`` trains under: compiled, sharded, checkpointed (the module docstring says what is read)."""
    modules = list(pl_module.modules())
    compiled = bool(compiled_modules(pl_module))
    sharded = any(isinstance(p, DTensor) for p in pl_module.parameters())
    checkpointed = any(isinstance(m, CheckpointWrapper) or is_checkpointed(m) for m in modules)
    return Stack(compiled=compiled, sharded=sharded, checkpointed=checkpointed)


def stack_problems(trainer: Any, pl_module: nn.Module, supported: Stack, who: str) -> list[str]:
    """What of the fit's stack ``who`` (a method serving ``supported``) cannot run under, each with why ([] if none).

    Args:
        trainer: the fit's Trainer (its ``strategy`` is read).
        pl_module: the learner, after ``configure_model`` (the stack is applied).
        supported: the method's declaration.
        who: the method's name, for the messages.

    Example::

        stack_problems(trainer, compiled_learner, Stack(), "OPUSSelection")
        # ['OPUSSelection does not run under a compiled learner (torch.compile); it serves the eager learner ...']
    """
    problems = _strategy_problems(getattr(trainer, "strategy", None), who)
    used = fit_stack(pl_module)
    served = ", ".join(["the eager learner on one device or under DDP"]
                       + [what for part, what in _WHAT.items() if getattr(supported, part)])
    for part, what in _WHAT.items():
        if getattr(used, part) and not getattr(supported, part):
            problems.append(f"{who} does not run under {what}; it serves {served} (fp32 or bf16-mixed): "
                            f"{supported.reason} (docs/stack.md)")
    return problems


def _strategy_problems(strategy: Any, who: str) -> list[str]:
    """The strategy refused for every method: anything but one device, DDP and FSDP2 without tensor parallelism."""
    served = isinstance(strategy, _SERVED_STRATEGIES) and not isinstance(strategy, DeepSpeedStrategy)  # a DDP subclass
    if strategy is None or served and not _tensor_parallel(strategy):
        return []
    return [f"{who} does not run under {type(strategy).__name__}: online selection runs on one device, under DDP "
            "(strategy='ddp') or FSDP2 (ModelParallelStrategy(data_parallel_size=<devices>, tensor_parallel_size=1)); "
            "it gathers whole candidate rows from every rank and gives each rank whole rows back, which DeepSpeed, "
            "FSDP1 and tensor parallelism do not keep"]


def _tensor_parallel(strategy: Any) -> bool:
    """Whether a ``ModelParallelStrategy``'s mesh splits the model over more than its data-parallel dimension."""
    mesh = getattr(strategy, "_device_mesh", None) if isinstance(strategy, ModelParallelStrategy) else None
    names = getattr(mesh, "mesh_dim_names", None) or ()
    return mesh is not None and "tensor_parallel" in names and mesh["tensor_parallel"].size() > 1

