"""CUDA checks (skipped without a GPU; CI has none): the ghost engine under bf16 autocast, held Muon points on the
device, a bf16 train.py run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from selection_callbacks.nn.gpt import GPT, GPTConfig
from selection_callbacks.nn.optim import build_optimizer
from selection_callbacks.scoring.ghost.engine import GhostEngine
from selection_callbacks.scoring.losses import mean_token_losses as row_losses
from selection_callbacks.scoring.maps.step_maps import OptimizerStepMaps

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
ROOT = Path(__file__).resolve().parents[1]


def _rank_corr(a: torch.Tensor, b: torch.Tensor) -> float:
    ra, rb = a.argsort().argsort().double(), b.argsort().argsort().double()
    return float(torch.corrcoef(torch.stack([ra, rb]))[0, 1])


@pytest.mark.parametrize("opt_name", ["adamw", "muon"])
def test_engine_under_bf16_autocast_tracks_fp32(opt_name: str) -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=320, block_size=64, n_layer=4, n_head=4, n_embd=256)).cuda()
    opt = build_optimizer(model, opt_name, 3e-3, 0.1, (0.9, 0.95), 0.02, 0.95, 0.0)
    for _ in range(5):
        ids = torch.randint(0, 256, (16, 65), device="cuda")
        opt.zero_grad()
        row_losses(model)({"input_ids": ids[:, :-1], "labels": ids[:, 1:]}).mean().backward()
        opt.step()
    opt.zero_grad(set_to_none=True)
    text = torch.randint(0, 256, (72, 65), generator=torch.Generator().manual_seed(1)).cuda()
    text[:32, 1::2] = text[:32, 0:1]  # half the candidates partly repetitive: a real spread of utilities
    rows = {"input_ids": text[:, :-1], "labels": text[:, 1:]}
    engine = GhostEngine(model, sketch_dim=256)
    fp32 = engine.score(row_losses(model), rows, 64, OptimizerStepMaps(opt))
    with torch.autocast("cuda", dtype=torch.bfloat16):
        bf16 = engine.score(row_losses(model), rows, 64, OptimizerStepMaps(opt))
    assert torch.isfinite(bf16.utilities).all() and float(bf16.utilities.abs().max()) > 0
    assert _rank_corr(fp32.utilities.float().cpu(), bf16.utilities.float().cpu()) > 0.95
    assert all(p.grad is None for p in model.parameters())


def test_train_py_opus_bf16_on_gpu(tmp_path: Path, tiny_corpus: dict[str, str]) -> None:
    cmd = [sys.executable, str(ROOT / "train.py"), "fit", "--config", str(ROOT / "configs/scale/gpu-small.yaml"),
           "--config", str(ROOT / "configs/method/opus.yaml"), "--data.pool", tiny_corpus["pool"],
           "--data.target", tiny_corpus["target"], "--data.val", tiny_corpus["val"], "--data.seq_len", "128",
           "--data.batch_size", "8", "--data.num_workers", "0", "--data.val_samples", "32", "--trainer.max_steps", "6",
           "--trainer.val_check_interval", "6", "--trainer.logger", "false", "--trainer.enable_checkpointing", "false",
           "--trainer.default_root_dir", str(tmp_path), "--data.progress", "false", "--model.warmup_steps", "2"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["global_step"] == 6 and metrics["val_bpb"] is not None
    assert metrics["selection"]["selections"] == 6
