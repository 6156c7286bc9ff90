"""The training stack applied to a learner's transformer blocks: activation checkpointing, FSDP2, ``torch.compile``.

:meth:`~models.language_model.LitLanguageModel.configure_model` applies them in this order, the one FSDP2
and compile compose in: checkpointing replaces each block's forward
(:func:`selection_callbacks.nn.checkpointing.checkpoint_activations`), ``fully_shard`` makes each block and
then the root a FSDP2 unit over the data-parallel mesh, and ``Module.compile`` compiles each block in
place (FSDP2's hooks are ``torch._dynamo.disable``-d, so their all-gathers and frees run eagerly around
the compiled forward). Every step is in place: parameter names and
``state_dict`` keys stay those of the eager model, so optimizers, checkpoints and selection methods that
read parameters by name see the same names under every stack.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard

__all__ = ["compile_blocks", "shard"]


def shard(model: nn.Module, blocks: Sequence[nn.Module], mesh: DeviceMesh) -> None:
    """FSDP2: each block, then the root ``model`` (embeddings, final norm, head), sharded over ``mesh`` (1-D).

    Parameters become ``DTensor`` shards (dim 0 split over the mesh); a block's full weights are
    all-gathered for its forward and backward and freed after, gradients are reduce-scattered.

    Example::

        shard(model, model.blocks, trainer.strategy.device_mesh["data_parallel"])
    """
    for block in blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


def compile_blocks(blocks: Sequence[nn.Module]) -> None:
    """``torch.compile`` (inductor) each block in place: ``block.compile()``, names and keys unchanged.

    The blocks share one compiled code object; Dynamo recompiles for a new input shape (superbatch N,
    kept K, validation batch), grad mode and train/eval mode, then runs from its cache.

    Example::

        compile_blocks(model.blocks)
    """
    for block in blocks:
        block.compile(backend="inductor")
