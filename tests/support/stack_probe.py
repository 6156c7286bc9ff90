"""Test-only callback: the stack a ``train.py`` fit trains under, written to a JSON file (tests/test_gpu.py)."""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import torch
from torch.distributed.tensor import DTensor
from typing_extensions import override

from selection_callbacks.callbacks.stack import fit_stack


class StackProbe(L.Callback):
    """At the start of training (after ``configure_model`` applied the stack), rank zero writes
    ``{"compiled", "sharded", "checkpointed", "backend", "world_size", "meshes", "device", "precision"}`` to
    ``path``: the learner's :func:`~selection_callbacks.callbacks.stack.fit_stack`, the process group's backend
    and size (None without one), the distinct device-mesh shapes of its DTensor parameters, its device type and
    the trainer's precision.

    Example::

        python train.py fit ... --trainer.callbacks+=stack_probe.StackProbe --trainer.callbacks.path=stack.json

    Args:
        path: the JSON file to write.
    """

    def __init__(self, path: str) -> None:
        self.path = path

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        stack, grouped = fit_stack(pl_module), torch.distributed.is_initialized()
        meshes = sorted({tuple(p.device_mesh.shape) for p in pl_module.parameters() if isinstance(p, DTensor)})
        probe = {"compiled": stack.compiled, "sharded": stack.sharded, "checkpointed": stack.checkpointed,
                 "backend": torch.distributed.get_backend() if grouped else None,
                 "world_size": torch.distributed.get_world_size() if grouped else None,
                 "meshes": [list(m) for m in meshes], "device": pl_module.device.type,
                 "precision": trainer.precision}
        if trainer.is_global_zero:
            Path(self.path).write_text(json.dumps(probe))
