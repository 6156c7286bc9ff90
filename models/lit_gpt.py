"""The GPT as a LightningModule with the per-sample loss protocol and bits-per-byte validation."""

from __future__ import annotations

from typing import Literal

import torch

from models.language_model import LitLanguageModel
from selection_callbacks.nn.gpt import GPT, GPTConfig


class LitGPT(LitLanguageModel):
    """GPT trained on (selected) superbatches.

    ``per_sample_loss(batch) -> Tensor[N]`` is the protocol selection methods use: the mean
    token loss of each sequence under the current weights, honouring ``loss_mask``.

    Example::

        model = LitGPT(GPTConfig(n_layer=4, n_embd=128), optimizer="muon")
        trainer = L.Trainer(callbacks=[HighLossSelection(ratio=0.5)], max_steps=100)

    Args:
        config: model shape.
        optimizer: ``"adamw"``, or ``"muon"`` (Muon on hidden matrices, AdamW on the rest).
        lr: AdamW learning rate (peak).
        weight_decay: AdamW decoupled weight decay on 2-D weights.
        betas: AdamW betas.
        muon_lr: Muon learning rate (peak).
        muon_momentum: Muon momentum.
        muon_weight_decay: Muon decoupled weight decay.
        warmup_steps: linear warmup steps.
        min_lr_ratio: final LR as a fraction of the peak (cosine decay over the run).
        compile: ``torch.compile`` (inductor) each transformer block in place (docs/stack.md).
        activation_checkpointing: recompute each block's activations in the backward (non-reentrant).
    """

    def __init__(
        self,
        config: GPTConfig = GPTConfig(),
        optimizer: Literal["adamw", "muon"] = "adamw",
        lr: float = 3e-3,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        muon_lr: float = 0.02,
        muon_momentum: float = 0.95,
        muon_weight_decay: float = 0.0,
        warmup_steps: int = 20,
        min_lr_ratio: float = 0.1,
        compile: bool = False,
        activation_checkpointing: bool = False,
    ) -> None:
        super().__init__(config.vocab_size, compile, activation_checkpointing)
        self.save_hyperparameters()
        self.config = config
        self.model = GPT(config)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids)

    def transformer_blocks(self) -> list[torch.nn.Module]:
        """The GPT's blocks."""
        return list(self.model.blocks)
