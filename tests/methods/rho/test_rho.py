"""RHO-LOSS with real tiny models: the reference command, scores, precomputed losses, pretraining and errors."""

from __future__ import annotations

import copy
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch

from models.lit_gpt import LitGPT
from selection_callbacks.cli import reference_losses
from selection_callbacks.core.rng import micro_batch_generator
from selection_callbacks.core.selection import SelectionRecord
from selection_callbacks.data.datamodule import PoolDataModule
from selection_callbacks.methods import RhoLossSelection
from selection_callbacks.nn.flops import matmul_flops_per_token
from selection_callbacks.scoring.losses import per_sample_loss
from selection_callbacks.scoring.proxy_models import ProxyLM
from selection_callbacks.scoring.reference import load_reference
from selection_callbacks.scoring.reference_losses import ReferenceLossTable
from selection_callbacks.scoring.windows import score_windows
from tests.support.learnability import SEQ_LEN, assert_learnability_order, trained_models


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return trained_models(tmp_path_factory.mktemp("rho"))


def _select(trained: dict, selector: RhoLossSelection, steps: int = 1, seq_len: int = SEQ_LEN, pool: str | None = None,
            ) -> tuple[SelectionRecord, PoolDataModule]:
    """Fit a copy of the trained learner for ``steps`` steps (N = 64, K = 32); the last selection."""
    corpus = trained["corpus"]
    trainer = L.Trainer(accelerator="cpu", max_steps=steps, callbacks=[selector], logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0)
    dm = PoolDataModule(pool or corpus["pool"], corpus["target"], corpus["val"], seq_len=seq_len, batch_size=32,
                        ratio=0.5, progress=False)
    trainer.fit(copy.deepcopy(trained["learner"]), datamodule=dm)
    return selector.last_record, dm


def test_reference_losses_score_where_the_math_says(trained: dict) -> None:
    selector = RhoLossSelection(ratio=0.5, reference=str(trained["ckpt"]))
    record, dm = _select(trained, selector)
    reference = load_reference(trained["ckpt"])
    assert_learnability_order(record, dm.domain_names, trained["learner"], reference)
    metrics = selector.extra_metrics()
    tokens = 64 * SEQ_LEN  # one forward of each model over the superbatch; no backward
    assert metrics["select/cost/learner_fwd_tokens"] == metrics["select/cost/reference_fwd_tokens"] == tokens
    assert metrics["select/cost/fwd_per_update"] == 2 * 64 / 32 and metrics["select/cost/bwd_per_update"] == 0


def test_precomputed_losses_match_the_checkpoint(trained: dict, tmp_path: Path, capsys) -> None:
    out = tmp_path / "pool_losses.npz"
    reference_losses.main(["--ckpt", str(trained["ckpt"]), "--pool", trained["corpus"]["pool"],
                           "--seq-len", str(SEQ_LEN), "--out", str(out), "--batch-size", "50"])
    assert "215 sequences" in capsys.readouterr().out  # 18 documents × 12 sequences, the last without its final label
    live, _ = _select(trained, RhoLossSelection(ratio=0.5, reference=str(trained["ckpt"])))
    lookup = RhoLossSelection(ratio=0.5, reference_losses=str(out))
    looked_up, _ = _select(trained, lookup)
    assert torch.equal(live.sample_id, looked_up.sample_id)
    torch.testing.assert_close(looked_up.scores, live.scores, atol=1e-4, rtol=0)
    assert torch.equal(looked_up.selected, live.selected)
    assert "select/cost/reference_fwd" not in lookup.extra_metrics()  # no reference forward when looking up

    with pytest.raises(ValueError, match="seq_len=32, the pool is packed at 16"):
        _select(trained, RhoLossSelection(ratio=0.5, reference_losses=str(out)), seq_len=16)
    with pytest.raises(ValueError, match="made for another pool"):
        _select(trained, RhoLossSelection(ratio=0.5, reference_losses=str(out)), pool=trained["corpus"]["target"])
    table, rows = ReferenceLossTable.read(out), looked_up.batch
    torch.testing.assert_close(table.lookup(rows), table.loss[rows["sample_id"]], rtol=0, atol=0)  # ids 0 … 214
    with pytest.raises(KeyError, match=r"sample_id\(s\) \[215\] are not in"):
        table.lookup({**rows, "sample_id": torch.where(rows["sample_id"] == rows["sample_id"][0], 215, rows["sample_id"])})
    shuffled = {**rows, "input_ids": rows["input_ids"].roll(1, dims=0)}  # each id beside another row's tokens
    with pytest.raises(ValueError, match=r"the rows of sample_id\(s\) .* hold other tokens"):
        table.lookup(shuffled)
    with pytest.raises(FileNotFoundError, match="selection-callbacks reference-losses"):
        ReferenceLossTable.read(tmp_path / "missing.npz")
    np.savez(tmp_path / "other.npz", scores=np.zeros(3))
    with pytest.raises(ValueError, match="not a reference loss file"):
        ReferenceLossTable.read(tmp_path / "other.npz")


def test_pretrained_reference_reads_only_target_batches(trained: dict) -> None:
    selector = RhoLossSelection(ratio=0.5, reference_steps=4, reference_batch_size=8, proxy_layers=1, proxy_width=32,
                                proxy_heads=2)
    calls: list[int] = []
    original = PoolDataModule.target_batch

    def spy(self, n, generator):
        calls.append(n)
        return original(self, n, generator)

    PoolDataModule.target_batch = spy  # type: ignore[method-assign]
    try:
        _select(trained, selector, steps=3)
    finally:
        PoolDataModule.target_batch = original  # type: ignore[method-assign]
    reference = selector.reference.proxy
    assert selector.reference.kind == "built" and selector.reference.ready
    assert calls == [2] + [8] * 4 and reference.steps == 4 and reference.frozen  # the fit-start check's draw, then 4 steps'
    # pretraining, counted once and apart from the per-step passes: one scoring forward per step
    assert selector.meter.total["reference_pretrain_bwd"] == selector.meter.total["reference_pretrain_fwd"] == [4, 4 * 8 * SEQ_LEN]
    assert selector.meter.total["reference_fwd"] == [3, 3 * 64 * SEQ_LEN] and "reference_bwd" not in selector.meter.total
    assert 0 < selector.extra_metrics()["select/scoring_fraction"] <= 1
    cost = selector.summary()["cost"]
    assert cost["reference_pretrain_bwd"] == {"passes": 4, "tokens": 4 * 8 * SEQ_LEN}
    flops = selector.summary()["flops_per_token"]
    assert flops["reference"] == matmul_flops_per_token(reference.module) == 2 * (3 * 32 * 32 + 32 * 32 + 2 * 4 * 32 * 32 + 32 * 320)
    assert flops["learner"] > flops["reference"]


def test_clear_errors(trained: dict, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="RhoLossSelection needs a reference"):
        RhoLossSelection(reference_steps=0)
    with pytest.raises(ValueError, match="not both"):
        RhoLossSelection(reference="a.ckpt", reference_losses="a.npz")
    with pytest.raises(FileNotFoundError, match="reference checkpoint .* does not exist"):
        _select(trained, RhoLossSelection(reference=str(tmp_path / "missing.ckpt")))
    (tmp_path / "junk.ckpt").write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="is refused: it is not a torch.save file"):
        _select(trained, RhoLossSelection(reference=str(tmp_path / "junk.ckpt")))
    reference, learner = load_reference(trained["ckpt"]), LitGPT.load_from_checkpoint(trained["ckpt"]).eval()
    assert isinstance(reference, ProxyLM) and reference.config == learner.config
    batch = {"input_ids": torch.randint(0, reference.config.vocab_size, (3, 16))}
    with torch.no_grad():
        assert torch.equal(reference.per_sample_loss(batch), learner.per_sample_loss(batch))


def test_windowed_scores_are_both_models_losses_on_the_same_windows(trained: dict) -> None:
    """score_len = 8: the score is ℓ_learner − ℓ_reference on each candidate's seeded 8-token window (the first
    selection, before any step, scores with the learner as trained), and each forward costs 8 tokens a row."""
    selector = RhoLossSelection(ratio=0.5, reference=str(trained["ckpt"]), score_len=8)
    record, _ = _select(trained, selector)
    windows = score_windows(record.batch, 8, micro_batch_generator(selector.seed, record.epoch, record.micro_batch, "window"))
    with torch.no_grad():
        want = per_sample_loss(trained["learner"], windows) - per_sample_loss(load_reference(trained["ckpt"]), windows)
    torch.testing.assert_close(record.scores, want.float(), rtol=1e-4, atol=1e-5)
    assert selector.meter.total["learner_fwd"] == selector.meter.total["reference_fwd"] == [1, 64 * 8]
    with pytest.raises(ValueError, match="not reference_losses"):
        RhoLossSelection(reference_losses="pool_losses.npz", score_len=8)


class MaskBlind(LitGPT):
    """A learner whose per_sample_loss ignores loss_mask."""

    def per_sample_loss(self, batch):
        return super().per_sample_loss({k: v for k, v in batch.items() if k != "loss_mask"})


def test_windows_in_context_are_scored_after_their_prefix(trained: dict) -> None:
    """window_context: each candidate's 8-token window (the windows of score_len = 8 alone) is scored by both models
    after its prefix: a forward of the prefix and window alone, the loss on the window; each forward costs T tokens."""
    selector = RhoLossSelection(ratio=0.5, reference=str(trained["ckpt"]), score_len=8, window_context=True)
    record, _ = _select(trained, selector)
    gen = micro_batch_generator(selector.seed, record.epoch, record.micro_batch, "window")
    starts = torch.randint(0, SEQ_LEN - 8 + 1, (64,), generator=gen).tolist()
    reference = load_reference(trained["ckpt"])
    ids, labels = record.batch["input_ids"], record.batch["labels"]
    with torch.no_grad():
        want = torch.stack([
            torch.nn.functional.cross_entropy(trained["learner"](ids[r : r + 1, : o + 8])[0, o:], labels[r, o : o + 8])
            - torch.nn.functional.cross_entropy(reference.model(ids[r : r + 1, : o + 8])[0, o:], labels[r, o : o + 8])
            for r, o in enumerate(starts)])
    torch.testing.assert_close(record.scores, want.float(), rtol=1e-4, atol=1e-5)
    assert selector.meter.total["learner_fwd"] == selector.meter.total["reference_fwd"] == [1, 64 * SEQ_LEN]
    with pytest.raises(ValueError, match="give score_len"):
        RhoLossSelection(window_context=True)


@pytest.mark.parametrize("given", [True, False])
def test_windows_in_context_refuse_a_loss_that_ignores_loss_mask(trained: dict, given: bool) -> None:
    """Before the first step when the fit draws target rows (a built reference), at the first superbatch when it
    does not (a given one): the problem and the fix named either way."""
    learner = copy.deepcopy(trained["learner"])
    learner.__class__ = MaskBlind
    selector = RhoLossSelection(ratio=0.5, reference=str(trained["ckpt"]) if given else None, reference_steps=1,
                                score_len=8, window_context=True)
    start = "cannot score windows in context" if given else "cannot start"
    with pytest.raises(ValueError, match=f"{start}:\n- window_context=True .* the learner's per_sample_loss ignores "
                                         "loss_mask .*or drop window_context"):
        _select({**trained, "learner": learner}, selector)
