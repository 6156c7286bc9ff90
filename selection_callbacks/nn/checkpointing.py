"""Activation checkpointing of a model's blocks in place, and how to recognise it.

A checkpointed block's ``forward`` is replaced by a function that runs the original under
``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``: no module is wrapped, so parameter
names and ``state_dict`` keys stay those of the plain model, and ``Module.compile()`` of the block traces
the checkpoint as one region (Dynamo's checkpoint operator).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch.nn as nn
from torch.utils.checkpoint import checkpoint

__all__ = ["checkpoint_activations", "is_checkpointed"]


def checkpoint_activations(blocks: Sequence[nn.Module]) -> None:
    """Recompute each block's activations in the backward instead of storing them (non-reentrant checkpointing).

    Values and gradients are those of the plain forward (the recomputation repeats the same operations);
    the memory held between forward and backward drops to each block's input.

    Example::

        checkpoint_activations(model.blocks)
        assert is_checkpointed(model.blocks[0])
    """
    for block in blocks:
        if is_checkpointed(block):
            continue
        forward = block.forward

        def checkpointed(*args: Any, _forward: Any = forward, **kwargs: Any) -> Any:
            return checkpoint(_forward, *args, use_reentrant=False, **kwargs)

        checkpointed.checkpointed_forward = forward  # the original, and the mark is_checkpointed reads
        block.forward = checkpointed


def is_checkpointed(module: nn.Module) -> bool:
    """Whether :func:`checkpoint_activations` checkpointed ``module``."""
    return hasattr(module.__dict__.get("forward"), "checkpointed_forward")
