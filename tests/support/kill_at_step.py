"""Test-only callback: SIGKILL the training process when it reaches a step (the kill-and-resume test)."""

from __future__ import annotations

import os
import signal
from typing import Any

import lightning as L
from typing_extensions import override


class KillAtStep(L.Callback):
    """Kills its own process, with no cleanup, at the start of the first micro-batch of ``step``.

    Args:
        step: the ``trainer.global_step`` to die at.
    """

    def __init__(self, step: int) -> None:
        self.step = step

    @override
    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)
