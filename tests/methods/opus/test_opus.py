"""OPUS and GREATS behaviour in real Trainer runs on a tiny GPT."""

from __future__ import annotations

import statistics

import lightning as L
import numpy as np
import pytest
import torch

from models.lit_gpt import LitGPT
from selection_callbacks.core.sampling import SequentialBoltzmann, effective_sample_size
from selection_callbacks.data.datamodule import PoolDataModule
from selection_callbacks.methods import GreatsSelection, OPUSSelection
from selection_callbacks.nn.gpt import GPTConfig

CFG = GPTConfig(vocab_size=320, block_size=32, n_layer=2, n_head=2, n_embd=32)


class Metrics(L.Callback):
    """Collects the select/* metrics of every micro-batch, the selector's diagnostics of that micro-batch included."""

    def __init__(self) -> None:
        self.rows: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        row = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("select/")}
        selector = next(c for c in trainer.callbacks if isinstance(c, OPUSSelection | GreatsSelection))
        self.rows.append({**row, **selector.last_diagnostics})


def _fit(corpus, selector, steps: int, optimizer: str = "adamw", batch_size: int = 8, ratio: float = 0.5,
         extra: list[L.Callback] = ()):
    torch.manual_seed(0)
    seen = Metrics()
    trainer = L.Trainer(accelerator="cpu", max_steps=steps, callbacks=[selector, seen, *extra], logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, log_every_n_steps=1)
    dm = PoolDataModule(corpus["pool"], corpus["target"], corpus["val"], seq_len=32, batch_size=batch_size,
                        ratio=ratio, progress=False)
    trainer.fit(LitGPT(CFG, optimizer=optimizer, warmup_steps=2), datamodule=dm)
    return seen


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_opus_picks_the_target_domain(tiny_corpus, optimizer: str) -> None:
    selector = OPUSSelection(ratio=0.5, score_len=16, sketch_dim=256, temperature=0.5)
    _fit(tiny_corpus, selector, steps=50, optimizer=optimizer)
    counts = selector.domain_counts
    share = counts.get("prose", 0) / sum(counts.values())
    assert share > 0.7, f"prose share {share:.2f} (base rate 0.5)"


def test_greats_picks_the_target_domain(tiny_corpus) -> None:
    selector = GreatsSelection(ratio=0.5, score_len=16, sketch_dim=256)
    _fit(tiny_corpus, selector, steps=15)
    assert selector.domain_counts.get("prose", 0) / sum(selector.domain_counts.values()) > 0.8


def test_default_opus_ess_strictly_between_k_and_n(tiny_corpus) -> None:
    seen = _fit(tiny_corpus, OPUSSelection(ratio=0.5, score_len=16, sketch_dim=256, diagnostics_every=1), steps=12)
    median = statistics.median(r["select/ess"] for r in seen.rows)
    assert 8.0 < median < 16.0, f"median ESS {median} must lie strictly between K=8 and N=16"
    assert all("select/redundancy_changed" in r for r in seen.rows)


def _scores_and_interactions(corpus, duplicates: int):
    """A trained model's OPUS scores on a superbatch whose first rows are copies of one prose sequence."""
    captured = {}

    class Capture(OPUSSelection):
        def calibrate(self, scores, k):
            out = super().calibrate(scores, k)
            captured.setdefault("scores", out)
            return out

    class DuplicatingDM(PoolDataModule):
        def train_dataloader(self):
            base = super().train_dataloader()

            class Loader:
                def __iter__(self_inner):
                    for batch in base:
                        prose = int((batch["domain"] == self.domain_names.index("prose")).nonzero()[0])
                        for key in ("input_ids", "labels", "sample_id", "domain"):
                            batch[key][:duplicates] = batch[key][prose]
                        yield batch

                def __len__(self_inner):
                    return len(base)

            return Loader()

    torch.manual_seed(0)
    trainer = L.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        callbacks=[Capture(ratio=0.25, score_len=32, sketch_dim=512, redundancy_weight=8.0)])
    dm = DuplicatingDM(corpus["pool"], corpus["target"], corpus["val"], seq_len=32, batch_size=4, ratio=0.25,
                       progress=False)
    trainer.fit(LitGPT(CFG, warmup_steps=1), datamodule=dm)
    return captured["scores"]


def test_duplicates_are_rarely_picked_together_with_redundancy(tiny_corpus) -> None:
    scores = _scores_and_interactions(tiny_corpus, duplicates=2)
    values, inter = scores.values, scores.interactions
    torch.testing.assert_close(values[0], values[1])  # identical candidates, identical utility
    torch.testing.assert_close(inter[0, 1], inter[0, 0])  # and the full self-similarity as penalty
    values = values.clone()
    values[:2] = values.max()  # a duplicated pair among the best candidates
    rule = SequentialBoltzmann(1.0)

    def both_chosen(interactions) -> float:
        picks = [set(rule.select(values, 4, torch.Generator().manual_seed(s), interactions).tolist()) for s in range(400)]
        return float(np.mean([{0, 1} <= p for p in picks]))

    with_penalty, without = both_chosen(inter), both_chosen(None)
    assert without > 0.2 and with_penalty < 0.5 * without, (with_penalty, without)


def test_temperature_limits(tiny_corpus) -> None:
    g = torch.Generator().manual_seed(0)
    values = torch.randn(16, generator=g)
    inter = torch.rand(16, 16, generator=g) * 0.1
    greedy = SequentialBoltzmann(0.0).select(values, 8, torch.Generator(), inter)
    cold = SequentialBoltzmann(1e-6).select(values, 8, torch.Generator().manual_seed(3), inter)
    assert greedy.tolist() == cold.tolist()
    hot = SequentialBoltzmann(1e6, mc_draws=4000).inclusion(values, 8, torch.Generator().manual_seed(4), inter)
    assert effective_sample_size(hot) == pytest.approx(16.0, rel=0.02)
    assert effective_sample_size(SequentialBoltzmann(0.0).inclusion(values, 8, torch.Generator(), inter)) == 8.0


def test_opus_refuses_a_datamodule_without_target_rows(tiny_corpus) -> None:
    class NoTarget(LitGPT):
        def train_dataloader(self):
            dm = PoolDataModule(tiny_corpus["pool"], tiny_corpus["target"], tiny_corpus["val"], seq_len=32,
                                batch_size=4, ratio=0.5, progress=False)
            dm.prepare_data()
            dm.setup()
            return dm.train_dataloader()

    trainer = L.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, callbacks=[OPUSSelection(ratio=0.5, score_len=16)])
    with pytest.raises(ValueError, match=r"without a datamodule, has no target_batch\(n, rng\).*"
                                         r"or pass target_file=FILE"):
        trainer.fit(NoTarget(CFG, warmup_steps=1))


def test_opus_with_a_target_file_scores_against_the_files_rows(tiny_corpus) -> None:
    """target_file=FILE draws its rows from the file: a run with the val file as target file scores and selects
    exactly as a run whose datamodule's target split is that file (windows of the whole 32-token rows, so both pack
    the same rows and draw them by the same rule), and unlike a run drawing the datamodule's own target split."""
    def fit(corpus, target_file):
        selector = OPUSSelection(ratio=0.5, score_len=32, sketch_dim=128, target_file=target_file)
        _fit(corpus, selector, steps=3)
        return selector

    from_file = fit(tiny_corpus, tiny_corpus["val"])
    as_target = fit({**tiny_corpus, "target": tiny_corpus["val"]}, None)
    own_target = fit(tiny_corpus, None)
    assert from_file.selections == 3
    torch.testing.assert_close(from_file.last_scores, as_target.last_scores)
    assert from_file.last_selected.tolist() == as_target.last_selected.tolist()
    assert not torch.allclose(from_file.last_scores, own_target.last_scores)


def test_opus_scores_only_the_named_layers(tiny_corpus) -> None:
    selector = OPUSSelection(ratio=0.5, score_len=16, sketch_dim=64, layers=["blocks.1.mlp.*"])
    _fit(tiny_corpus, selector, steps=2)
    assert [n for n, _ in selector.engine.layers] == ["blocks.1.mlp.fc", "blocks.1.mlp.proj"]
    assert set(selector._last.layer_utilities) == {"blocks.1.mlp.fc", "blocks.1.mlp.proj"}
    with pytest.raises(ValueError, match="at least one pattern"):
        OPUSSelection(layers=[])


def test_opus_candidate_chunks_keep_the_selections(tiny_corpus) -> None:
    """Scoring candidates in chunks (flat memory) selects what one pass selects."""
    one, chunked = (OPUSSelection(ratio=0.5, score_len=16, sketch_dim=64, candidate_chunk=c) for c in (None, 3))
    _fit(tiny_corpus, one, steps=3, optimizer="muon")
    _fit(tiny_corpus, chunked, steps=3, optimizer="muon")
    assert chunked.engine.candidate_chunk == 3
    torch.testing.assert_close(chunked.last_scores, one.last_scores, rtol=1e-4, atol=1e-6)
    assert chunked.last_selected.tolist() == one.last_selected.tolist()


def test_opus_without_redundancy_builds_no_sketches(tiny_corpus) -> None:
    selector = OPUSSelection(ratio=0.5, score_len=16, sketch_dim=256, redundancy_weight=0.0)
    seen = _fit(tiny_corpus, selector, steps=2)
    assert selector.engine.sketch_dim == 0 and selector._last.sketches is None
    assert all("select/redundancy_changed" not in r for r in seen.rows)


def test_opus_scores_windows_in_context_over_whole_rows(tiny_corpus) -> None:
    """window_context: candidates and target rows stay 32 tokens wide (the meter counts T = 4 L tokens a row where
    windows alone count L), and the scores differ from those of the same windows alone."""
    in_context = OPUSSelection(ratio=0.5, score_len=8, sketch_dim=64, window_context=True)
    alone = OPUSSelection(ratio=0.5, score_len=8, sketch_dim=64)
    _fit(tiny_corpus, in_context, steps=2)
    _fit(tiny_corpus, alone, steps=2)
    tokens = {s: s.meter.total["learner_fwd"][1] for s in (in_context, alone)}  # scoring and diagnostic passes
    assert tokens[in_context] == 4 * tokens[alone] >= 4 * 2 * (16 + 8) * 8
    assert not torch.allclose(in_context.last_scores, alone.last_scores)


def test_opus_windows_in_context_refuse_a_target_file_and_a_mask_blind_loss(tiny_corpus) -> None:
    with pytest.raises(ValueError, match="target_file rows are packed as score_len windows"):
        OPUSSelection(window_context=True, target_file=tiny_corpus["target"])

    class MaskBlind(LitGPT):
        def per_sample_loss(self, batch):
            return super().per_sample_loss({k: v for k, v in batch.items() if k != "loss_mask"})

    trainer = L.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, callbacks=[OPUSSelection(score_len=8, window_context=True)])
    dm = PoolDataModule(tiny_corpus["pool"], tiny_corpus["target"], tiny_corpus["val"], seq_len=32, batch_size=8,
                        ratio=0.5, progress=False)
    with pytest.raises(ValueError, match="OPUSSelection cannot start:\n- window_context=True .* the learner's "
                                         "per_sample_loss ignores loss_mask"):
        trainer.fit(MaskBlind(CFG, warmup_steps=1), datamodule=dm)
