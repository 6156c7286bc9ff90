"""Test-only callback: SIGKILL the training process when it reaches a step (the kill-and-resume tests)."""

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
        rank: only the process of this global rank dies (None: every process).
    """

    def __init__(self, step: int, rank: int | None = None) -> None:
        self.step, self.rank = step, rank

    @override
    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self.step and self.rank in (None, trainer.global_rank):
            os.kill(os.getpid(), signal.SIGKILL)
