"""The superbatch contract under a real Trainer: training_step sees exactly the chosen K rows."""

from __future__ import annotations

import csv
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader

from models.lit_gpt import LitGPT
from selection_callbacks.callbacks.base import SelectionCallback
from selection_callbacks.callbacks.dashboard import SelectionDashboard
from selection_callbacks.core.contract import SuperbatchError, subset_in_place
from selection_callbacks.data.datamodule import PoolDataModule
from selection_callbacks.methods import HighLossSelection, RandomSelection
from selection_callbacks.nn.gpt import GPTConfig

CFG = GPTConfig(vocab_size=320, block_size=32, n_layer=1, n_head=2, n_embd=32)


class RecordingGPT(LitGPT):
    """Remembers what each training_step received."""

    def __init__(self) -> None:
        super().__init__(CFG, warmup_steps=1)
        self.seen: list[dict[str, torch.Tensor]] = []

    def training_step(self, batch, batch_idx):
        self.seen.append({k: v.clone() for k, v in batch.items()})
        return super().training_step(batch, batch_idx)


class RecordingSelection(HighLossSelection):
    """High-loss selection that also remembers the superbatch and its scores."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.superbatches: list[dict[str, torch.Tensor]] = []
        self.scores: list[torch.Tensor] = []

    def score(self, trainer, pl_module, batch, batch_idx):
        self.superbatches.append({k: v.clone() for k, v in batch.items()})
        s = super().score(trainer, pl_module, batch, batch_idx)
        self.scores.append(s.clone())
        return s


class ConstantScores(SelectionCallback):
    def __init__(self, scores: torch.Tensor, **kw) -> None:
        super().__init__(sampling="top_k", **kw)
        self.fixed = scores

    def score(self, trainer, pl_module, batch, batch_idx):
        return self.fixed.clone()


def _trainer(callbacks, steps: int = 3, **kw) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu", max_steps=steps, callbacks=callbacks, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, log_every_n_steps=1, **kw,
    )


def _dm(corpus, batch_size: int = 4, ratio: float = 0.5) -> PoolDataModule:
    return PoolDataModule(corpus["pool"], corpus["target"], corpus["val"], seq_len=32, batch_size=batch_size,
                          ratio=ratio, progress=False)


@pytest.mark.parametrize("accumulate", [1, 2])
def test_training_step_sees_exactly_the_chosen_rows(tiny_corpus, accumulate: int) -> None:
    model, selector = RecordingGPT(), RecordingSelection(ratio=0.5)
    _trainer([selector], steps=3, accumulate_grad_batches=accumulate).fit(model, datamodule=_dm(tiny_corpus))
    assert len(model.seen) == len(selector.superbatches) == 3 * accumulate  # one selection per micro-batch
    for seen, full, scores in zip(model.seen, selector.superbatches, selector.scores):
        assert full["input_ids"].shape[0] == 8 and seen["input_ids"].shape[0] == 4
        top = torch.sort(scores, descending=True, stable=True).indices[:4]
        for key in ("input_ids", "labels", "sample_id", "domain"):
            assert torch.equal(seen[key], full[key][top]), key


class Diagnostics(L.Callback):
    """The selector's diagnostic scalars of every micro-batch."""

    def __init__(self, selector) -> None:
        self.selector, self.seen = selector, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.seen.append(dict(self.selector.last_diagnostics))


def test_selection_metrics_reach_the_loggers_on_their_steps_only(tiny_corpus, tmp_path) -> None:
    """The select/* and throughput scalars are handed to Lightning on the steps it writes logs (every
    log_every_n_steps), each from that step's micro-batch; the selection's totals count every step."""
    logged: list[int] = []

    class Spy(RandomSelection):
        def _metrics(self, *args, **kwargs):
            logged.append(self.selections)
            return super()._metrics(*args, **kwargs)

    selector = Spy(ratio=0.5)
    trainer = L.Trainer(accelerator="cpu", max_steps=6, callbacks=[selector, SelectionDashboard()],
                        logger=CSVLogger(tmp_path, name="csv"), log_every_n_steps=3, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0)
    trainer.fit(LitGPT(CFG, warmup_steps=1), datamodule=_dm(tiny_corpus))
    assert logged == [3, 6]  # computed on the 3rd and 6th selections only
    rows = list(csv.DictReader((Path(trainer.logger.log_dir) / "metrics.csv").open()))
    steps = sorted({int(r["step"]) for r in rows if r.get("select/kept_fraction")})
    assert steps == [2, 5]  # Lightning writes steps 3 and 6 (0-based 2 and 5)
    assert sorted({int(r["step"]) for r in rows if r.get("throughput/update_tokens_per_sec")}) == [2, 5]
    assert selector.selections == 6 and selector.summary()["kept"] == 6 * 4


def test_selection_metrics_are_logged(tiny_corpus) -> None:
    """Every micro-batch logs its scalars; the ESS only on the diagnostic selections (the first of every 100)."""
    selector = RandomSelection(ratio=0.5)
    diagnostics = Diagnostics(selector)
    trainer = _trainer([selector, diagnostics], steps=2)
    trainer.fit(LitGPT(CFG, warmup_steps=1), datamodule=_dm(tiny_corpus))
    m = trainer.callback_metrics
    assert m["select/kept_fraction"] == 0.5 and "select/ess" not in m
    assert diagnostics.seen == [{"select/ess": pytest.approx(8.0)}, {}]
    shares = [float(v) for k, v in m.items() if k.startswith("select/domain/")]
    assert shares and sum(shares) == pytest.approx(1.0)
    assert float(m["select/overhead_ms"]) > 0
    assert selector.summary()["kept"] == 8 and selector.summary()["candidates_seen"] == 16


def test_subset_in_place_keeps_the_dict_object_and_lists() -> None:
    batch = {"input_ids": torch.arange(12).view(4, 3), "note": ["a", "b", "c", "d"], "meta": torch.tensor(7),
             "weight": np.arange(4.0), "pair": ("w", "x", "y", "z")}
    same = batch
    subset_in_place(batch, torch.tensor([2, 0]), ["input_ids", "note", "weight"])
    assert same is batch and batch["input_ids"].tolist() == [[6, 7, 8], [0, 1, 2]]
    assert batch["note"] == ["c", "a"] and batch["meta"].item() == 7 and batch["weight"].tolist() == [2.0, 0.0]
    assert batch["pair"] == ("w", "x", "y", "z")  # not named: passes through uncut


class OneBatch:
    """A one-batch iterable (a plain list would be read by Lightning as several loaders)."""

    def __init__(self, batch) -> None:
        self.batch = batch

    def __iter__(self):
        yield {k: v.clone() for k, v in self.batch.items()}

    def __len__(self) -> int:
        return 1


def _fit_with_loader(callback, loader) -> None:
    class Bare(LitGPT):
        def train_dataloader(self):
            return loader

    _trainer([callback], steps=1).fit(Bare(CFG, warmup_steps=1))


def test_non_dict_batch_is_rejected() -> None:
    loader = DataLoader(torch.utils.data.TensorDataset(torch.randint(0, 256, (8, 32))), batch_size=8)
    with pytest.raises(SuperbatchError, match="dict batch"):
        _fit_with_loader(RandomSelection(0.5), loader)


def test_missing_input_ids_is_rejected() -> None:
    loader = OneBatch({"tokens": torch.randint(0, 256, (8, 32))})
    with pytest.raises(SuperbatchError, match="no 'input_ids'"):
        _fit_with_loader(RandomSelection(0.5), loader)


def test_mismatched_per_sample_key_is_rejected() -> None:
    loader = OneBatch({"input_ids": torch.randint(0, 256, (8, 32)), "sample_id": torch.arange(5)})
    with pytest.raises(SuperbatchError, match="'sample_id' has shape"):
        _fit_with_loader(RandomSelection(0.5), loader)


def test_superbatch_smaller_than_k_is_rejected() -> None:
    loader = OneBatch({"input_ids": torch.randint(0, 256, (4, 32))})
    with pytest.raises(SuperbatchError, match="fewer than k=6"):
        _fit_with_loader(RandomSelection(k=6), loader)


@pytest.mark.parametrize("ratio", [0.0, 1.2])
def test_callback_ratio_outside_unit_interval(ratio: float) -> None:
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        RandomSelection(ratio=ratio)


def test_nan_scores_raise_by_default() -> None:
    loader = OneBatch({"input_ids": torch.randint(0, 256, (4, 32)), "sample_id": torch.arange(10, 14)})
    scores = torch.tensor([1.0, float("nan"), 0.5, float("inf")])
    with pytest.raises(FloatingPointError, match=r"2 non-finite score\(s\).*samples \[11, 13\]"):
        _fit_with_loader(ConstantScores(scores, ratio=0.5), loader)


def test_nan_scores_rank_lowest_when_asked() -> None:
    model = RecordingGPT()

    loader = OneBatch({"input_ids": torch.randint(0, 256, (4, 32)), "sample_id": torch.arange(10, 14)})
    scores = torch.tensor([float("nan"), 1.0, float("-inf"), 0.5])
    model.train_dataloader = lambda: loader
    with pytest.warns(UserWarning, match="non-finite selection score"):
        _trainer([ConstantScores(scores, ratio=0.5, nonfinite="lowest")], steps=1).fit(model)
    assert model.seen[0]["sample_id"].tolist() == [11, 13]


def test_public_api_exports_every_method() -> None:
    import selection_callbacks

    for name in ("RandomSelection", "HighLossSelection", "OPUSSelection", "GreatsSelection", "OracleDomainSelection",
                 "PoolDataModule", "RunRecorder", "SelectionCallback", "Scores"):
        assert hasattr(selection_callbacks, name), name
