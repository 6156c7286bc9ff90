"""Test helper: a 5-step train.py fit of a tiny GPT logging to an offline W&B run, with every logged dict kept."""

from __future__ import annotations

from pathlib import Path

import pytest
import wandb

import train

ROOT = Path(__file__).resolve().parents[2]


def wandb_fit(corpus: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, method: str,
              extra: list[str]) -> tuple[object, list[dict]]:
    """The CLI of ``train.py fit`` with ``configs/method/<method>.yaml`` and ``extra`` flags, and what it logged."""
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    logged: list[dict] = []
    log = wandb.sdk.wandb_run.Run.log

    def spy(self, data, *args, **kwargs):
        logged.append(dict(data))
        return log(self, data, *args, **kwargs)

    monkeypatch.setattr(wandb.sdk.wandb_run.Run, "log", spy)
    cli = train.main([
        "fit", "--config", str(ROOT / "configs/scale/cpu-tiny.yaml"), "--config", str(ROOT / f"configs/method/{method}.yaml"),
        "--config", str(ROOT / "configs/logger/wandb.yaml"), "--trainer.logger.init_args.save_dir", str(tmp_path),
        "--data.pool", corpus["pool"], "--data.target", corpus["target"], "--data.val", corpus["val"],
        "--data.seq_len", "32", "--data.progress", "false", "--data.val_samples", "16",
        "--model.config.n_layer", "1", "--model.config.n_embd", "32", "--model.config.n_head", "2",
        "--trainer.max_steps", "5", "--trainer.val_check_interval", "5", "--trainer.log_every_n_steps", "1",
        "--trainer.enable_progress_bar", "false", "--trainer.default_root_dir", str(tmp_path / "run"), *extra,
    ])
    return cli, logged
