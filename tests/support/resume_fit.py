"""Test helper: fit a tiny GPT with random selection and record each step's trained sample ids (resume tests)."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from models.lit_gpt import LitGPT
from selection_callbacks.methods import RandomSelection
from selection_callbacks.nn.gpt import GPTConfig


class SeenIds(L.Callback):
    """The ``sample_id`` rows each training step receives, in order."""

    def __init__(self) -> None:
        self.ids: list[list[int]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.ids.append(batch["sample_id"].tolist())


def fit_recording_ids(dm: L.LightningDataModule, root: Path, steps: int, ckpt_every: int | None = None,
                      ckpt_path: str | None = None) -> SeenIds:
    """Fits a 1-block GPT (block 32) on ``dm`` for ``steps`` steps under ``RandomSelection(0.5, seed=1)``,
    checkpointing every ``ckpt_every`` steps into ``root`` and resuming from ``ckpt_path`` when given."""
    torch.manual_seed(0)
    seen = SeenIds()
    callbacks = [RandomSelection(0.5, seed=1), seen]
    if ckpt_every:
        callbacks.append(ModelCheckpoint(dirpath=root, every_n_train_steps=ckpt_every, save_top_k=-1))
    trainer = L.Trainer(accelerator="cpu", max_steps=steps, callbacks=callbacks, logger=False,
                        enable_progress_bar=False, limit_val_batches=0, enable_model_summary=False,
                        enable_checkpointing=bool(ckpt_every))
    trainer.fit(LitGPT(GPTConfig(block_size=32, n_layer=1, n_head=2, n_embd=32), warmup_steps=1), datamodule=dm,
                ckpt_path=ckpt_path)
    return seen
