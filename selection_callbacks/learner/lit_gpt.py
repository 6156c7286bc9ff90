"""The GPT as a LightningModule with the per-sample loss protocol and bits-per-byte validation."""

from __future__ import annotations

import math
from typing import Any, Literal

import lightning as L
import torch
from torchmetrics import SumMetric
from typing_extensions import override

from selection_callbacks.nn.gpt import GPT, GPTConfig
from selection_callbacks.nn.optim import build_optimizer, warmup_cosine
from selection_callbacks.data.tokenizer import ByteTokenizer
from selection_callbacks.scoring.losses import sequence_means, token_losses


class LitGPT(L.LightningModule):
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
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.config = config
        self.model = GPT(config)
        self.register_buffer("token_bytes", ByteTokenizer().token_bytes(config.vocab_size), persistent=False)
        self.val_nats = SumMetric()
        self.val_tokens = SumMetric()
        self.val_byte_nats = SumMetric()
        self.val_bytes = SumMetric()

    @override
    def setup(self, stage: str) -> None:
        dm = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
        vocab = getattr(dm, "vocab_size", None)
        if vocab is not None and vocab > self.config.vocab_size:
            raise ValueError(f"data vocabulary {vocab} exceeds model.config.vocab_size={self.config.vocab_size}")
        seq_len = getattr(dm, "seq_len", None)
        if seq_len is not None and seq_len > self.config.block_size:
            raise ValueError(f"data.seq_len={seq_len} exceeds model.config.block_size={self.config.block_size}")
        tokenizer = getattr(dm, "tokenizer", None)
        if tokenizer is not None:
            table = tokenizer.token_bytes(self.config.vocab_size)
            self.token_bytes = None if table is None else table[: self.config.vocab_size].to(self.device)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids)

    def per_sample_loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Mean token loss of each sequence, [N] (masked tokens excluded)."""
        nll, mask, _ = token_losses(self.model(batch["input_ids"]), batch)
        return sequence_means(nll, mask)

    @override
    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.per_sample_loss(batch).mean()
        self.log("train/loss", loss, prog_bar=True, batch_size=batch["input_ids"].shape[0])
        return loss

    @override
    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        nll, mask, targets = token_losses(self.model(batch["input_ids"]), batch)
        self.val_nats.update((nll * mask).sum())
        self.val_tokens.update(mask.sum())
        if self.token_bytes is not None:  # unknown for pre-tokenized data without a byte table
            nbytes = self.token_bytes[targets] * mask
            self.val_byte_nats.update((nll * (nbytes > 0)).sum())
            self.val_bytes.update(nbytes.sum())

    @override
    def on_validation_epoch_end(self) -> None:
        tokens, nbytes = self.val_tokens.compute(), self.val_bytes.compute()
        if tokens > 0:
            self.log("val/loss", self.val_nats.compute() / tokens, prog_bar=True)
        if nbytes > 0:
            self.log("val/bpb", self.val_byte_nats.compute() / (math.log(2) * nbytes), prog_bar=True)
        for metric in (self.val_nats, self.val_tokens, self.val_byte_nats, self.val_bytes):
            metric.reset()

    @override
    def configure_optimizers(self) -> dict[str, Any]:
        hp = self.hparams
        opt = build_optimizer(
            self.model, hp.optimizer, hp.lr, hp.weight_decay, tuple(hp.betas), hp.muon_lr, hp.muon_momentum,
            hp.muon_weight_decay,
        )
        total = self.trainer.estimated_stepping_batches
        if not math.isfinite(total):
            raise ValueError("set trainer.max_steps (or max_epochs) so the cosine schedule knows the run length")
        sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(hp.warmup_steps, int(total), hp.min_lr_ratio))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
