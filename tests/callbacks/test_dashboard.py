"""SelectionDashboard: W&B histograms, domain tables and run summary (offline), throughput for any logger."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import lightning as L
import pytest
import torch
import wandb
from lightning.pytorch.loggers import CSVLogger

from models.lit_gpt import LitGPT
from selection_callbacks.callbacks.dashboard import SelectionDashboard
from selection_callbacks.data.datamodule import PoolDataModule
from selection_callbacks.methods import RandomSelection
from selection_callbacks.nn.gpt import GPTConfig
from tests.support.wandb_fit import wandb_fit


def test_wandb_offline_run_holds_histograms_tables_and_summary(tiny_corpus, tmp_path: Path, monkeypatch) -> None:
    cli, logged = wandb_fit(tiny_corpus, tmp_path, monkeypatch, "high_loss", ["--dashboard.histogram_every", "2"])
    run = cli.trainer.logger.experiment
    try:
        for key in ("selection/scores_chosen", "selection/scores_rejected"):
            steps = [d["trainer/global_step"] for d in logged if isinstance(d.get(key), wandb.Histogram)]
            assert steps == [0, 2, 4], key
        chosen = next(d["selection/scores_chosen"] for d in logged if "selection/scores_chosen" in d)
        assert sum(chosen.histogram) == 16  # K of the first superbatch
        tables = sorted((Path(run.dir) / "media" / "table" / "selection").glob("domains_*.table.json"))
        assert len(tables) == 3
        table = json.loads(tables[0].read_text())
        assert table["columns"] == ["domain", "candidates", "chosen", "share_of_chosen", "kept_fraction"]
        assert {row[0] for row in table["data"]} <= {"prose", "noise"} and sum(row[2] for row in table["data"]) == 16
        assert any("throughput/update_tokens_per_sec" in d for d in logged)
        summary = {key: run.summary[key] for key in run.summary.keys()}
        for key in ("select/score_mean", "select/kept_fraction", "select/ess", "throughput/mean_update_tokens_per_sec"):
            assert key in summary, key
        assert summary["selection/method"] == "HighLossSelection" and summary["selection/kept"] == 5 * 16
        assert summary["selection/candidates_seen"] == 5 * 32
    finally:
        run.finish()
    assert Path(run.dir).parent.name.startswith("offline-run-") and Path(run.dir).is_relative_to(tmp_path)


def test_throughput_reaches_a_csv_logger(tiny_corpus, tmp_path: Path) -> None:
    torch.manual_seed(0)
    trainer = L.Trainer(accelerator="cpu", max_steps=4, callbacks=[RandomSelection(0.5), SelectionDashboard()],
                        logger=CSVLogger(tmp_path, name="csv"), log_every_n_steps=1, enable_progress_bar=False,
                        enable_checkpointing=False, enable_model_summary=False, limit_val_batches=0)
    dm = PoolDataModule(tiny_corpus["pool"], tiny_corpus["target"], tiny_corpus["val"], seq_len=32, batch_size=4,
                        ratio=0.5, progress=False)
    trainer.fit(LitGPT(GPTConfig(block_size=32, n_layer=1, n_head=2, n_embd=32)), datamodule=dm)
    rows = list(csv.DictReader((Path(trainer.logger.log_dir) / "metrics.csv").open()))
    rates = [(float(r["throughput/candidate_tokens_per_sec"]), float(r["throughput/update_tokens_per_sec"]))
             for r in rows if r.get("throughput/update_tokens_per_sec")]
    assert len(rates) == 4 and all(u > 0 for _, u in rates)
    assert all(c == pytest.approx(2 * u) for c, u in rates)  # N = 2K candidates per update


def test_histogram_every_must_be_positive() -> None:
    with pytest.raises(ValueError, match="histogram_every"):
        SelectionDashboard(histogram_every=0)
