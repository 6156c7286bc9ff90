"""HighLossSelection in a real Trainer run: its scores are the learner's per-row losses, and it keeps the top K."""

from __future__ import annotations

import copy

import lightning as L
import pytest
import torch
import torch.nn.functional as F

from models.lit_gpt import LitGPT
from selection_callbacks.data.datamodule import PoolDataModule
from selection_callbacks.methods import HighLossSelection
from selection_callbacks.nn.gpt import GPTConfig


def _fit(corpus: dict[str, str], learner: LitGPT, selector: HighLossSelection) -> PoolDataModule:
    trainer = L.Trainer(accelerator="cpu", max_steps=1, callbacks=[selector], logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0)
    dm = PoolDataModule(corpus["pool"], corpus["target"], corpus["val"], seq_len=32, batch_size=8, ratio=0.5,
                        progress=False)
    trainer.fit(learner, datamodule=dm)
    return dm


def _row_losses(model: LitGPT, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Brute force: each row's mean cross-entropy against its ``labels`` (``loss_mask`` tokens), one row at a time."""
    rows = []
    with torch.no_grad():
        for i, row in enumerate(batch["input_ids"]):
            nll = F.cross_entropy(model(row[None])[0].float(), batch["labels"][i], reduction="none")
            mask = batch["loss_mask"][i].float() if "loss_mask" in batch else torch.ones_like(nll)
            rows.append((nll * mask).sum() / mask.sum())
    return torch.stack(rows)


def test_scores_are_the_learners_row_losses_and_the_top_k_is_kept(tiny_corpus: dict[str, str]) -> None:
    torch.manual_seed(0)
    learner = LitGPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, vocab_size=320, block_size=32), warmup_steps=1)
    before = copy.deepcopy(learner).eval()  # the weights the first step scored with
    selector = HighLossSelection(ratio=0.5, seed=0)
    _fit(tiny_corpus, learner, selector)
    record = selector.last_record
    assert record.step == 0 and record.scores.shape == (16,) and record.selected.shape == (8,)
    assert "labels" in record.batch
    torch.testing.assert_close(record.scores, _row_losses(before, record.batch), rtol=1e-5, atol=1e-5)
    kept = set(record.selected.tolist())
    assert kept == set(torch.topk(record.scores, 8).indices.tolist())
    assert record.scores[record.selected].min() >= record.scores[~record.selected_mask].max()


def test_it_counts_one_learner_forward_per_candidate_token(tiny_corpus: dict[str, str]) -> None:
    learner = LitGPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, vocab_size=320, block_size=32), warmup_steps=1)
    selector = HighLossSelection(ratio=0.5)
    _fit(tiny_corpus, learner, selector)
    metrics = selector.meter.metrics(kept_tokens=8 * 32)
    assert metrics["select/cost/learner_fwd_tokens_total"] == 16 * 32, metrics
    assert metrics["select/cost/fwd_per_update"] == 2.0 and "select/cost/learner_bwd_total" not in metrics


def test_a_learner_without_per_sample_loss_is_refused(tiny_corpus: dict[str, str]) -> None:
    class Bare(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Linear(1, 1)

        def training_step(self, batch, batch_idx):
            return self.w(torch.ones(1, 1)).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    with pytest.raises(ValueError, match="per_sample_loss"):
        _fit(tiny_corpus, Bare(), HighLossSelection(ratio=0.5))
