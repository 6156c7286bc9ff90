"""OracleDomainSelection in a real Trainer run: every target-domain candidate first, random within and after."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from models.lit_gpt import LitGPT
from selection_callbacks.data.datamodule import PoolDataModule
from selection_callbacks.methods import OracleDomainSelection
from selection_callbacks.nn.gpt import GPTConfig


def _record(corpus: dict[str, str], selector: OracleDomainSelection):
    trainer = L.Trainer(accelerator="cpu", max_steps=2, callbacks=[selector], logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0)
    dm = PoolDataModule(corpus["pool"], corpus["target"], corpus["val"], seq_len=32, batch_size=8, ratio=0.25,
                        progress=False)
    learner = LitGPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, vocab_size=320, block_size=32), warmup_steps=1)
    trainer.fit(learner, datamodule=dm)
    return selector.last_record, dm


@pytest.mark.parametrize("target_domains", [None, ["noise"]])
def test_target_domains_come_first(tiny_corpus: dict[str, str], target_domains: list[str] | None) -> None:
    record, dm = _record(tiny_corpus, OracleDomainSelection(ratio=0.25, target_domains=target_domains, seed=3))
    wanted = set(target_domains or dm.splits["target"].domain_names)
    in_target = torch.tensor([dm.domain_names[int(c)] in wanted for c in record.domain])
    assert 0 < int(in_target.sum()) < record.scores.numel(), "the superbatch should mix target and other domains"
    kept = record.selected_mask
    if int(in_target.sum()) >= kept.sum():
        assert in_target[kept].all()
    else:
        assert kept[in_target].all()
    assert (record.scores[in_target] >= 1).all() and (record.scores[~in_target] < 1).all()


def test_the_order_within_is_seeded(tiny_corpus: dict[str, str]) -> None:
    a, _ = _record(tiny_corpus, OracleDomainSelection(ratio=0.25, seed=1))
    b, _ = _record(tiny_corpus, OracleDomainSelection(ratio=0.25, seed=1))
    c, _ = _record(tiny_corpus, OracleDomainSelection(ratio=0.25, seed=2))
    assert torch.equal(a.scores, b.scores) and torch.equal(a.selected, b.selected)
    assert not torch.equal(a.scores, c.scores)
