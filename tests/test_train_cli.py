"""train.py end to end: one short run per shipped config, and mid-epoch resume through Lightning."""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import pytest

import train
from models.hf_causal_lm import LitCausalLM
from models.lit_gpt import LitGPT
from selection_callbacks.callbacks.base import SelectionCallback
from selection_callbacks.data.datamodule import PoolDataModule
from selection_callbacks.methods import RandomSelection
from tests.support.resume_fit import SeenIds, fit_recording_ids

ROOT = Path(__file__).resolve().parents[1]
METHODS = sorted(p.stem for p in (ROOT / "configs" / "method").glob("*.yaml"))
SCALES = sorted(p.stem for p in (ROOT / "configs" / "scale").glob("*.yaml"))
TINY = ["--model.config.n_layer", "1", "--model.config.n_embd", "32", "--model.config.n_head", "2"]


def _data_args(corpus: dict[str, str]) -> list[str]:
    return ["--data.pool", corpus["pool"], "--data.target", corpus["target"], "--data.val", corpus["val"],
            "--data.seq_len", "32", "--data.progress", "false"]


@pytest.mark.parametrize("method", METHODS)
def test_short_run_per_method_config(tiny_corpus, tmp_path: Path, method: str, capsys) -> None:
    args = ["fit", "--config", str(ROOT / "configs/scale/cpu-tiny.yaml"), "--config",
            str(ROOT / f"configs/method/{method}.yaml"), *_data_args(tiny_corpus), *TINY,
            "--trainer.max_steps", "6", "--trainer.val_check_interval", "3", "--data.val_samples", "16",
            "--trainer.default_root_dir", str(tmp_path), "--trainer.enable_progress_bar", "false"]
    cli = train.main(args)
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["global_step"] == 6 and len(metrics["curve"]) == 2
    assert metrics["update_tokens"] == 6 * 16 * 32  # K=16 of N=32, 32 tokens each
    assert metrics["selection"]["kept"] == 6 * 16 and metrics["selection"]["candidates_seen"] == 6 * 32
    assert 0 < metrics["val_bpb"] < 20
    assert f"val_bpb={metrics['val_bpb']:.4f}" in capsys.readouterr().out
    # the selection's cumulative seconds at each validation, at the curve's points
    assert [p[0] for p in metrics["selection_curve"]] == [p[0] for p in metrics["curve"]]
    seconds = [p[1] for p in metrics["selection_curve"]]
    assert 0 <= seconds[0] <= seconds[1] == pytest.approx(metrics["selection"]["overhead_seconds"], abs=1e-3)
    assert cli.trainer.callbacks[0].ratio == 0.5  # linked from data.ratio


@pytest.mark.parametrize("scale", SCALES)
def test_scale_configs_parse(tiny_corpus, scale: str) -> None:
    args = ["--config", str(ROOT / f"configs/scale/{scale}.yaml"), "--config", str(ROOT / "configs/method/random.yaml"),
            *_data_args(tiny_corpus), "--trainer.accelerator", "cpu", "--trainer.precision", "32-true"]
    cli = train.SelectionCLI(L.LightningModule, PoolDataModule, subclass_mode_model=True, args=args, run=False)
    if isinstance(cli.model, LitGPT):
        assert cli.model.config.block_size == 32  # the GPT's context follows data.seq_len
    else:  # a scale that names a transformers learner (cpu-tiny-llama)
        assert isinstance(cli.model, LitCausalLM) and cli.model.config.max_position_embeddings >= 32
    assert isinstance(cli.trainer.callbacks[0], RandomSelection)


def _fit(corpus, root: Path, steps: int, ckpt_every: int | None = None, ckpt_path: str | None = None) -> SeenIds:
    dm = PoolDataModule(corpus["pool"], corpus["target"], corpus["val"], seq_len=32, batch_size=4, ratio=0.5,
                        seed=3, progress=False)
    return fit_recording_ids(dm, root, steps, ckpt_every, ckpt_path)


def test_mid_epoch_resume_continues_the_candidate_stream(tiny_corpus, tmp_path: Path) -> None:
    full = _fit(tiny_corpus, tmp_path / "a", steps=8)
    _fit(tiny_corpus, tmp_path / "b", steps=5, ckpt_every=3)
    resumed = _fit(tiny_corpus, tmp_path / "c", steps=8, ckpt_path=str(tmp_path / "b" / "epoch=0-step=3.ckpt"))
    assert resumed.ids == full.ids[3:]


@pytest.mark.parametrize("method, rule", [("random", "Uniform"), ("high_loss", "TopK"), ("oracle", "TopK"),
                                          ("opus", "SequentialBoltzmann"), ("greats", "SequentialBoltzmann"),
                                          ("rho", "TopK"), ("classact", "TopK"), ("classact_report", "TopK")])
def test_method_configs_keep_their_sampling_rule(tiny_corpus, method: str, rule: str) -> None:
    """CLI defaults of the base class must not override a method's own sampling rule."""
    args = ["--config", str(ROOT / "configs/scale/cpu-tiny.yaml"), "--config", str(ROOT / f"configs/method/{method}.yaml"),
            *_data_args(tiny_corpus), "--data.seed", "5"]
    cli = train.SelectionCLI(LitGPT, PoolDataModule, args=args, run=False)
    selector = cli.trainer.callbacks[0]
    assert type(selector.rule).__name__ == rule and selector.seed == 5


def test_resume_from_checkpoint_reproduces_the_run(tiny_corpus, tmp_path: Path) -> None:
    """Checkpointed state (model, optimizer, loader position, selector, recorder) resumes the same run."""
    base = ["fit", "--config", str(ROOT / "configs/scale/cpu-tiny.yaml"), "--config",
            str(ROOT / "configs/method/high_loss.yaml"), *_data_args(tiny_corpus), *TINY,
            "--trainer.max_steps", "6", "--trainer.val_check_interval", "3", "--data.val_samples", "16",
            "--trainer.enable_progress_bar", "false", "--trainer.enable_checkpointing", "true",
            "--trainer.callbacks+=ModelCheckpoint", "--trainer.callbacks.save_top_k=-1"]  # saved after each validation
    train.main([*base, "--trainer.default_root_dir", str(tmp_path / "full"),
                f"--trainer.callbacks.dirpath={tmp_path / 'full_ckpt'}"])
    ckpt = tmp_path / "full_ckpt" / "epoch=0-step=3.ckpt"
    assert ckpt.exists()
    train.main([*base, "--trainer.default_root_dir", str(tmp_path / "resumed"),
                f"--trainer.callbacks.dirpath={tmp_path / 'resumed_ckpt'}", "--ckpt_path", str(ckpt)])
    full = json.loads((tmp_path / "full" / "metrics.json").read_text())
    resumed = json.loads((tmp_path / "resumed" / "metrics.json").read_text())
    assert resumed["update_tokens"] == full["update_tokens"] and resumed["global_step"] == 6
    assert [p[0] for p in resumed["curve"]] == [p[0] for p in full["curve"]]
    assert [p[0] for p in resumed["selection_curve"]] == [p[0] for p in full["selection_curve"]]
    assert resumed["selection_curve"][0] == full["selection_curve"][0]  # the checkpoint's point, restored as written
    assert resumed["val_bpb"] == pytest.approx(full["val_bpb"], abs=1e-5)
    assert resumed["selection"]["kept"] == full["selection"]["kept"]
    assert resumed["selection"]["domains"] == pytest.approx(full["selection"]["domains"])


def test_no_selection_at_ratio_one_leaves_no_empty_callback(tiny_corpus) -> None:
    args = ["--config", str(ROOT / "configs/scale/cpu-tiny.yaml"), *_data_args(tiny_corpus), "--data.ratio", "1"]
    cli = train.SelectionCLI(LitGPT, PoolDataModule, args=args, run=False)
    assert None not in cli.trainer.callbacks
    assert not any(isinstance(c, SelectionCallback) for c in cli.trainer.callbacks)


def test_run_folders_keep_their_own_config_and_print_progress(tiny_corpus, tmp_path: Path, capsys) -> None:
    """Two runs beside one logger folder: each run folder holds its own resolved config.yaml; progress lines print."""
    base = ["fit", "--config", str(ROOT / "configs/scale/cpu-tiny.yaml"), "--config",
            str(ROOT / "configs/method/random.yaml"), *_data_args(tiny_corpus), *TINY, "--trainer.max_steps", "4",
            "--trainer.val_check_interval", "2", "--data.val_samples", "16", "--trainer.enable_progress_bar", "false",
            "--trainer.logger", "lightning.pytorch.loggers.CSVLogger", "--trainer.logger.save_dir", str(tmp_path / "logs"),
            "--recorder.progress_every", "1e-9"]
    for name, lr in (("a", "0.001"), ("b", "0.002")):
        train.main([*base, "--trainer.default_root_dir", str(tmp_path / name), "--model.lr", lr])
    for name, lr in (("a", 0.001), ("b", 0.002)):
        assert f"lr: {lr}" in (tmp_path / name / "config.yaml").read_text()
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[train] step")]
    assert lines and "update tokens in" in lines[-1] and "tok/s" in lines[-1] and "selection" in lines[-1]
