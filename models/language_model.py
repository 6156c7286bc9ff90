"""What every learner of this project shares: the per-sample loss protocol, training on the selected rows,
bits-per-byte validation, and AdamW or Muon+AdamW under a warmup-cosine schedule."""

from __future__ import annotations

import math
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info
from torchmetrics import SumMetric
from typing_extensions import override

from models.parallelize import compile_blocks, shard
from selection_callbacks.data.tokenizer import ByteTokenizer
from selection_callbacks.nn.checkpointing import checkpoint_activations
from selection_callbacks.nn.optim import build_optimizer, param_split, warmup_cosine
from selection_callbacks.scoring.losses import sequence_means, token_losses

__all__ = ["LitLanguageModel"]


def _tokenizer_name(dm: Any) -> str:
    tokenizer = getattr(dm, "tokenizer", None)
    path = getattr(tokenizer, "path", None)
    return str(path) if path is not None else type(tokenizer).__name__


class LitLanguageModel(L.LightningModule):
    """A causal LM ``self.model`` trained on (selected) superbatches; subclasses build the model.

    A subclass sets ``self.model`` (its ``config`` has ``vocab_size`` and the field named by
    :attr:`max_len_field`), implements ``forward(input_ids [N, T]) -> logits [N, T, V]``, and has the
    optimizer arguments of :class:`~models.lit_gpt.LitGPT` among its saved
    hyperparameters (``optimizer``, ``lr``, ``weight_decay``, ``betas``, ``muon_lr``, ``muon_momentum``,
    ``muon_weight_decay``, ``warmup_steps``, ``min_lr_ratio``).

    ``per_sample_loss(batch) -> Tensor[N]`` is the protocol selection methods use: the mean token loss
    of each row under the current weights, honouring ``labels`` and ``loss_mask``
    (:func:`~selection_callbacks.scoring.losses.token_losses`). Validation logs ``val/loss`` (nats per
    target token) and ``val/bpb`` (nats over the target tokens that stand for text, / (ln 2 · bytes)).
    Bytes come from the batch's ``label_bytes`` [N, T] when it has them (subword tokenizers: each
    token's original UTF-8 bytes, exact under normalisation), else from the tokenizer's byte table per id.

    The training stack (:meth:`configure_model`, docs/stack.md): ``activation_checkpointing``, FSDP2
    when the strategy provides a device mesh (Lightning's ``ModelParallelStrategy``), ``compile``; a
    subclass names its transformer blocks in :meth:`transformer_blocks`. All off, the model runs eagerly,
    as built.

    Example::

        class LitMine(LitLanguageModel):
            def __init__(self, width: int = 64, optimizer: str = "adamw", lr: float = 3e-3) -> None:
                super().__init__(vocab_size=320)
                self.save_hyperparameters()  # with the other optimizer arguments listed above
                self.model = MyLM(width)  # .config has vocab_size and block_size

            def forward(self, input_ids):
                return self.model(input_ids)

            def transformer_blocks(self):
                return list(self.model.blocks)

    Args:
        vocab_size: ids of the model's output (sizes the byte table behind ``val/bpb``).
        compile: ``torch.compile`` (inductor) each transformer block in place.
        activation_checkpointing: recompute each block's activations in the backward (non-reentrant).
    """

    max_len_field = "block_size"  # the model config's field bounding the sequence length

    def __init__(self, vocab_size: int, compile: bool = False, activation_checkpointing: bool = False) -> None:
        super().__init__()
        self.compiles_blocks, self.checkpoints_blocks = compile, activation_checkpointing
        self.stack_applied = False  # configure_model runs once per process (fit, then validate, call it again)
        self.register_buffer("token_bytes", ByteTokenizer().token_bytes(vocab_size), persistent=False)
        # bool [V] for ``label_bytes`` batches: ids that are not specials (a buffer: it moves with the module)
        self.register_buffer("text_ids", None, persistent=False)
        self.val_nats = SumMetric()
        self.val_tokens = SumMetric()
        self.val_byte_nats = SumMetric()
        self.val_bytes = SumMetric()

    @override
    def setup(self, stage: str) -> None:
        dm = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
        config = self.model.config
        vocab = getattr(dm, "vocab_size", None)
        if vocab is not None and vocab > config.vocab_size:
            raise ValueError(
                f"the data's tokenizer ({_tokenizer_name(dm)}) has {vocab} token ids but model.config.vocab_size="
                f"{config.vocab_size}; build the model for it: --model.config.vocab_size {64 * math.ceil(vocab / 64)} "
                "(a multiple of 64 ≥ the tokenizer's ids)"
            )
        seq_len, max_len = getattr(dm, "seq_len", None), getattr(config, self.max_len_field, None)
        if seq_len is not None and max_len is not None and seq_len > max_len:
            raise ValueError(f"data.seq_len={seq_len} exceeds model.config.{self.max_len_field}={max_len}")
        tokenizer = getattr(dm, "tokenizer", None)
        if tokenizer is not None:
            table = tokenizer.token_bytes(config.vocab_size)
            self.token_bytes = None if table is None else table[: config.vocab_size].to(self.device)
            if hasattr(tokenizer, "text_ids"):
                self.text_ids = tokenizer.text_ids(config.vocab_size).to(self.device)

    def transformer_blocks(self) -> list[torch.nn.Module]:
        """The model's transformer blocks, in order: the units of checkpointing, sharding and compiling.

        Raises:
            ValueError: the learner names no blocks (a subclass that wants the stack returns its blocks here).
        """
        raise ValueError(
            f"{type(self).__name__} does not name its transformer blocks: implement transformer_blocks() to use "
            "compile, activation_checkpointing or FSDP2 (ModelParallelStrategy)"
        )

    @override
    def configure_model(self) -> None:
        """Apply the training stack once: checkpointing, FSDP2 over the strategy's ``data_parallel`` mesh, compile.

        Raises:
            ValueError: the strategy's mesh splits devices over more than its ``data_parallel`` dimension (tensor
                parallelism; only FSDP2 is applied).
        """
        mesh = self.device_mesh
        if self.stack_applied or not (self.compiles_blocks or self.checkpoints_blocks or mesh is not None):
            return
        blocks = self.transformer_blocks()
        if self.checkpoints_blocks:
            checkpoint_activations(blocks)
        if mesh is not None:
            shard(self.model, blocks, self._data_parallel_mesh(mesh))
        if self.compiles_blocks:
            compile_blocks(blocks)
        self.stack_applied = True

    def _data_parallel_mesh(self, mesh: Any) -> Any:
        """The mesh's ``data_parallel`` dimension (the whole mesh when unnamed); refused when other dimensions split it."""
        data = mesh["data_parallel"] if "data_parallel" in (mesh.mesh_dim_names or ()) else mesh
        if data.size() != mesh.size():
            raise ValueError(
                f"{type(self).__name__} applies FSDP2 only, over {data.size()} of the mesh's {mesh.size()} devices: "
                "use ModelParallelStrategy(data_parallel_size=<devices>, tensor_parallel_size=1)"
            )
        return data

    def per_sample_loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Mean token loss of each sequence, [N] (masked tokens excluded)."""
        nll, mask, _ = token_losses(self(batch["input_ids"]), batch)
        return sequence_means(nll, mask)

    @override
    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.per_sample_loss(batch).mean()
        self.log("train/loss", loss, prog_bar=True, batch_size=batch["input_ids"].shape[0])
        return loss

    @override
    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        nll, mask, targets = token_losses(self(batch["input_ids"]), batch)
        self.val_nats.update((nll * mask).sum())
        self.val_tokens.update(mask.sum())
        if "label_bytes" in batch:  # per-position bytes: a token's count depends on where it sits
            text = mask if self.text_ids is None else mask * self.text_ids[targets]
            self.val_byte_nats.update((nll * text).sum())
            self.val_bytes.update((batch["label_bytes"].to(nll.dtype) * mask).sum())
        elif self.token_bytes is not None:  # unknown for pre-tokenized data without a byte table
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
        if hp.optimizer == "muon" and self.device_mesh is not None:
            raise ValueError(
                f"{type(self).__name__}: Muon does not run under FSDP2: its Newton-Schulz orthogonalisation needs "
                "each hidden matrix whole, and FSDP2 hands the optimizer row shards (DTensor); use --model.optimizer "
                "adamw with ModelParallelStrategy, or Muon with DDP"
            )
        rank_zero_info(f"{type(self).__name__}: " + param_split(self.model).describe(hp.optimizer))
        opt = build_optimizer(
            self.model, hp.optimizer, hp.lr, hp.weight_decay, tuple(hp.betas), hp.muon_lr, hp.muon_momentum,
            hp.muon_weight_decay,
        )
        total = self.trainer.estimated_stepping_batches
        if not math.isfinite(total):
            raise ValueError("set trainer.max_steps (or max_epochs) so the cosine schedule knows the run length")
        sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(hp.warmup_steps, int(total), hp.min_lr_ratio))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
