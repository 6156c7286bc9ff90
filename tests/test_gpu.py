"""CUDA checks (skipped without a GPU; CI has none). bench/gpu_check.sh runs them whenever a CUDA device is there.

Default group: the ghost engine under bf16 autocast (AdamW and Muon), held Muon points on the device, a bf16
train.py run of OPUS.

``stack`` group (``pytest -m stack tests/test_gpu.py``; bench/gpu_check.sh runs it under ``STACK_LIMIT``): the
training stack on CUDA, as tests/callbacks/test_stack.py and tests/callbacks/test_stack_fsdp.py check it on CPU.

* In-process fits (test_stack.py's recorder and comparison): a 4-layer, width-256 GPT at T = 128 is trained once
  (``PRETRAIN`` steps of AdamW on the toy pool); each fit starts from those weights and moments and runs on
  superbatches of N = 64 (K = 32). OPUS and RHO-LOSS (windows) under inductor-compiled blocks rank as the eager
  fit (Spearman ≥ 0.999, the same top-K but for near ties) and add no Dynamo graph over 10 steps after 4 warm-up
  steps; every online method under bf16-mixed scores the trained state as fp32 does (Spearman ≥ 0.98),
  its scores finite at every step.
* ``train.py`` runs in subprocesses, all at once on the one GPU: each online method at gpu-small under bf16-mixed
  trains and ledgers finite scores; OPUS and RHO-LOSS under FSDP2 on a one-GPU mesh (``ModelParallelStrategy``,
  NCCL, ``fully_shard`` over a mesh of 1) ledger what the single-device run does; OPUS at the GPT-2-small shape
  (gpu-gpt2: 12 × 768, T = 1024) under compile and bf16 trains with a steady graph count, and prints its step time.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import numpy as np
import pytest
import torch
from torch._dynamo.utils import counters

from models.lit_gpt import LitGPT
from selection_callbacks.callbacks.stack import fit_stack
from selection_callbacks.core.ledger_store import read_ledger
from selection_callbacks.data.datamodule import PoolDataModule
from selection_callbacks.nn.gpt import GPT, GPTConfig
from selection_callbacks.nn.optim import build_optimizer
from selection_callbacks.scoring.ghost.engine import GhostEngine
from selection_callbacks.scoring.losses import mean_token_losses as row_losses
from selection_callbacks.scoring.maps.step_maps import OptimizerStepMaps
from tests.callbacks.test_ledger import _launch
from tests.callbacks.test_stack import METHODS, STEPS, K, N, StepScores, Trained, _assert_ranks_agree

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


# ---- the stack group: in-process fits from a trained state (tests/callbacks/test_stack.py's, on CUDA) ----

SEQ, PRETRAIN = 128, 200  # the fits' T; AdamW steps that train their shared starting state
CUDA_GPT = GPTConfig(vocab_size=320, block_size=SEQ, n_layer=4, n_head=4, n_embd=256)
ONLINE = ("random", "high_loss", "oracle", "rho", "classact", "opus", "greats")  # every online method's default


def _datamodule(corpus: dict[str, str], cache: Path, **kwargs) -> PoolDataModule:
    return PoolDataModule(corpus["pool"], corpus["target"], corpus["val"], seq_len=SEQ, cache_dir=str(cache),
                          progress=False, **kwargs)


def _pretrain_on_gpu(corpus: dict[str, str], cache: Path) -> Trained:
    """``PRETRAIN`` steps of AdamW on random batches of 16 pool sequences, on the GPU: weights and moments there."""
    torch.manual_seed(0)
    learner = LitGPT(CUDA_GPT).cuda()
    hp = learner.hparams
    opt = build_optimizer(learner.model, "adamw", hp.lr, hp.weight_decay, tuple(hp.betas), hp.muon_lr,
                          hp.muon_momentum, hp.muon_weight_decay)
    dm = _datamodule(corpus, cache, batch_size=K)
    dm.setup("fit")
    pool, rng = dm.splits["pool"], np.random.default_rng(0)
    for _ in range(PRETRAIN):
        rows = pool.batch(rng.choice(len(pool), 16, replace=False))
        learner.per_sample_loss({k: v.cuda() for k, v in rows.items()}).mean().backward()
        opt.step()
        opt.zero_grad()
    names = {p: name for name, p in learner.model.named_parameters()}
    return Trained({k: v.clone() for k, v in learner.model.state_dict().items()},
                   {names[p]: {k: v.clone() for k, v in state.items()} for p, state in opt.state.items()})


def _fit_on_gpu(corpus: dict[str, str], cache: Path, state: Trained, method: str, steps: int = STEPS,
                precision: str = "32-true", **stack: bool) -> StepScores:
    """Fit the trained GPT on the GPU with ``method`` (of test_stack.py's ``METHODS``) and ``stack`` (``compile``):
    each step's scores [N] (on the CPU, float32), selections and graph count."""
    L.seed_everything(0)
    selector = METHODS[method]()
    record = StepScores(selector, state)
    trainer = L.Trainer(accelerator="gpu", devices=1, max_steps=steps, precision=precision,
                        callbacks=[selector, record], logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0)
    model = LitGPT(CUDA_GPT, warmup_steps=1, min_lr_ratio=1.0, **stack)  # LR not in steps
    model.model.load_state_dict(state.weights)
    trainer.fit(model, datamodule=_datamodule(corpus, cache, batch_size=K, ratio=K / N))
    assert len(record.scores) == steps and record.scores[0].shape == (N,)
    record.scores = [s.float().cpu() for s in record.scores]
    return record


@pytest.fixture(scope="module")
def gpu_fits(tiny_corpus, tmp_path_factory):
    """``fit(method, **options)``: :func:`_fit_on_gpu` from one shared trained state; eager fp32 fits (no options) are
    fitted on first use and kept."""
    cache = tmp_path_factory.getbasetemp() / "cache"
    state, eager = _pretrain_on_gpu(tiny_corpus, cache), {}

    def fit(method: str, **options) -> StepScores:
        if options:
            return _fit_on_gpu(tiny_corpus, cache, state, method, **options)
        if method not in eager:
            eager[method] = _fit_on_gpu(tiny_corpus, cache, state, method)
        return eager[method]

    return fit


@pytest.mark.stack
@pytest.mark.parametrize("method", ["opus", "rho_windows"])
def test_compiled_learner_on_gpu_scores_as_eager_without_recompiling(gpu_fits, method: str) -> None:
    """Inductor-compiled blocks on CUDA: scores rank as the eager fit's (Spearman ≥ 0.999, the same top-K but for
    near ties); after 4 warm-up steps 10 more add no Dynamo graph (0 recompiles)."""
    torch._dynamo.reset()
    counters.clear()
    compiled = gpu_fits(method, steps=14, compile=True)
    assert fit_stack(compiled.learner).compiled
    _assert_ranks_agree(compiled, gpu_fits(method), method, 0.999, top_k=True)
    assert compiled.graphs[-1] > 0  # the blocks did compile
    assert compiled.graphs[-1] == compiled.graphs[3], compiled.graphs


@pytest.mark.stack
@pytest.mark.parametrize("method", ONLINE)
def test_bf16_mixed_on_gpu_scores_rank_as_fp32(gpu_fits, method: str) -> None:
    """bf16-mixed autocast on CUDA: finite scores at every step; at step 0 (the trained state, scored in bf16 and in
    fp32) Spearman ≥ 0.98 to fp32's (random: the same scores and selection).

    Later steps compare states trained apart (the bf16 fit's updates came from bf16 gradients too); OPUS's ranks move
    most with that (Spearman 0.89 at step 2 on this GPT in CPU bf16, 0.999 at steps 0 and 1), so they are not
    compared here (tests/callbacks/test_stack.py compares every shared step on its 2 × 32 GPT)."""
    bf16, fp32 = gpu_fits(method, precision="bf16-mixed"), gpu_fits(method)
    assert all(torch.isfinite(s).all() for s in bf16.scores)
    first = SimpleNamespace(scores=bf16.scores[:1], selected=bf16.selected[:1])  # the trained state only
    _assert_ranks_agree(first, fp32, method, 0.98)


# ---- the stack group: train.py runs, all at once on the GPU ----

RUN_STEPS, RUN_K = 6, 8  # the gpu-small runs: steps, kept sequences a step (N = 16)
GPT2_STEPS, GPT2_K, GPT2_VALIDATE = 12, 4, 4  # the GPT-2-shape run: steps, K (N = 8), steps between validations
RUN_TIMEOUT = 420  # seconds all runs together may take
REFERENCE = ["--selection.init_args.reference_steps", "20"]  # RHO-LOSS's and ClassAct's reference proxy
ONE_GPU_FSDP2 = ["--trainer.devices", "1", "--trainer.strategy", "lightning.pytorch.strategies.ModelParallelStrategy",
                 "--trainer.strategy.data_parallel_size", "1", "--trainer.strategy.tensor_parallel_size", "1"]


def _train_args(corpus: dict[str, str], cache: Path, folder: Path, scale: str, method: str, *extra: str) -> list[str]:
    """``train.py`` arguments: ``scale`` and ``method`` configs on the toy corpus, writing to ``folder`` (with
    ``stack.json`` from tests/support/stack_probe.py)."""
    return ["fit", "--config", str(ROOT / f"configs/scale/{scale}.yaml"),
            "--config", str(ROOT / f"configs/method/{method}.yaml"),
            "--data.pool", corpus["pool"], "--data.target", corpus["target"], "--data.val", corpus["val"],
            "--data.cache_dir", str(cache), "--data.num_workers", "0", "--data.progress", "false",
            "--trainer.logger", "false", "--trainer.enable_checkpointing", "false",
            "--trainer.enable_progress_bar", "false",
            "--trainer.default_root_dir", str(folder), "--model.warmup_steps", "2",
            "--trainer.callbacks+=stack_probe.StackProbe", f"--trainer.callbacks.path={folder / 'stack.json'}", *extra]


def _train_runs(corpus: dict[str, str], cache: Path, root: Path) -> dict[str, list[str]]:
    """Each method at gpu-small under bf16-mixed (``<method>-bf16``); OPUS and RHO-LOSS (windows) in fp32 on one
    device and under FSDP2 on a one-GPU mesh (``-single``, ``-fsdp2``); OPUS at gpu-gpt2, compiled (``gpt2-opus``)."""
    small = ["--data.seq_len", str(SEQ), "--data.batch_size", str(RUN_K), "--data.val_samples", "32",
             "--trainer.max_steps", str(RUN_STEPS), "--trainer.val_check_interval", str(RUN_STEPS)]
    runs = {f"{m}-bf16": _train_args(corpus, cache, root / f"{m}-bf16", "gpu-small", m, *small,
                                     *(REFERENCE if m in ("rho", "classact") else [])) for m in ONLINE}
    for method, flags in (("opus", []), ("rho", [*REFERENCE, "--selection.init_args.score_len", "16"])):
        fp32 = [*small, *flags, "--trainer.precision", "32-true"]
        runs[f"{method}-single"] = _train_args(corpus, cache, root / f"{method}-single", "gpu-small", method, *fp32)
        runs[f"{method}-fsdp2"] = _train_args(corpus, cache, root / f"{method}-fsdp2", "gpu-small", method, *fp32,
                                              *ONE_GPU_FSDP2)
    runs["gpt2-opus"] = _train_args(
        corpus, cache, root / "gpt2-opus", "gpu-gpt2", "opus", "--data.batch_size", str(GPT2_K),
        "--trainer.accumulate_grad_batches", "1", "--data.val_samples", "8", "--data.val_batch_size", "4",
        "--trainer.max_steps", str(GPT2_STEPS), "--trainer.val_check_interval", str(GPT2_VALIDATE),
        "--model.compile", "true")
    return runs


@pytest.fixture(scope="module")
def train_runs(tiny_corpus, tmp_path_factory) -> dict[str, tuple[Path, int]]:
    """Every run of :func:`_train_runs` at once: name → (its folder, its exit code); runs still going after
    ``RUN_TIMEOUT`` s are killed."""
    root, cache = tmp_path_factory.mktemp("gpu_runs"), tmp_path_factory.getbasetemp() / "cache"
    for seq_len in (SEQ, 1024):  # tokenize once, before the concurrent runs (gpu-gpt2's T = 1024)
        PoolDataModule(tiny_corpus["pool"], tiny_corpus["target"], tiny_corpus["val"], seq_len=seq_len,
                       cache_dir=str(cache), progress=False).prepare_data()
    procs = {name: _launch(args, root / f"{name}.log") for name, args in _train_runs(tiny_corpus, cache, root).items()}
    deadline, codes = time.monotonic() + RUN_TIMEOUT, {}
    for name, proc in procs.items():
        try:
            codes[name] = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            codes[name] = proc.wait()
    return {name: (root / name, code) for name, code in codes.items()}


def _finished(runs: dict[str, tuple[Path, int]], name: str) -> tuple[Path, dict]:
    """Run ``name``'s folder and its ``stack.json``, once it is known to have exited 0."""
    folder, code = runs[name]
    assert code == 0, f"{name}: train.py exited {code}:\n{(folder.parent / f'{name}.log').read_text()[-4000:]}"
    return folder, json.loads((folder / "stack.json").read_text())


@pytest.mark.stack
@pytest.mark.parametrize("method", ONLINE)
def test_train_py_bf16_on_gpu_trains_with_finite_scores(train_runs, method: str) -> None:
    """gpu-small (6 × 384, T = 128) under bf16-mixed on the GPU: every candidate of every step ledgered, its score
    finite, half of them kept; a finite validation bpb at the end."""
    folder, probe = _finished(train_runs, f"{method}-bf16")
    assert (probe["device"], probe["precision"]) == ("cuda", "bf16-mixed")
    ledger = read_ledger(folder)
    assert ledger.num_rows == RUN_STEPS * 2 * RUN_K and sum(ledger.column("selected").to_pylist()) == RUN_STEPS * RUN_K
    assert np.isfinite(ledger.column("score").to_numpy()).all()
    metrics = json.loads((folder / "metrics.json").read_text())
    assert metrics["global_step"] == RUN_STEPS and math.isfinite(metrics["val_bpb"])


FSDP2_GAP = 1e-3  # the largest |score_FSDP2 − score_single| over the record's largest |score_single| allowed


@pytest.mark.stack
@pytest.mark.parametrize("method", ["opus", "rho"])
def test_fsdp2_on_one_gpu_ledger_equals_single_device(train_runs, method: str) -> None:
    """FSDP2 over a mesh of one GPU (NCCL): ``fully_shard`` applied (every parameter a DTensor on mesh (1,)), and the
    ledger is the single-device run's: the same ids, positions and selections, the scores within ``FSDP2_GAP``.

    On one rank FSDP2's collectives are copies and its gradient division is by 1, so the arithmetic is the
    single device's but for float32 rounding where operand layout changes a kernel's choice (the all-gathered
    weights live in FSDP2's buffer) and AdamW steps DTensors: O(√n·u) ≈ 2e-6 relative a step (n = K·T = 1024
    terms a gradient entry sums, u = 2⁻²⁴), a few times 1e-5 over 6 steps of a 6-layer GPT. A fault (a layer scored
    against another's weights or moments, a shard read as the whole) moves the scores by O(1) of their scale.
    """
    fsdp2, sharded = _finished(train_runs, f"{method}-fsdp2")
    single, plain = _finished(train_runs, f"{method}-single")
    assert {k: sharded[k] for k in ("sharded", "backend", "world_size", "meshes", "device")} == {
        "sharded": True, "backend": "nccl", "world_size": 1, "meshes": [[1]], "device": "cuda"}
    assert (plain["sharded"], plain["backend"], plain["device"]) == (False, None, "cuda")
    x, y = read_ledger(fsdp2), read_ledger(single)
    assert x.num_rows == y.num_rows == RUN_STEPS * 2 * RUN_K
    for column in ("record", "step", "micro_batch", "position", "sample_id", "selected"):
        assert x.column(column).to_pylist() == y.column(column).to_pylist(), column
    records, steps = x.column("record").to_numpy(), x.column("step").to_numpy()
    a, b = x.column("score").to_numpy(), y.column("score").to_numpy()
    scale = np.array([np.abs(b[records == r]).max() for r in records])
    gap = np.abs(a - b) / scale
    assert gap.max() <= FSDP2_GAP, f"largest relative gap {gap.max():.3g} (step {steps[gap.argmax()]})"
    print(f"{method}: FSDP2 on one GPU against one device, largest relative score gap {gap.max():.3g}")


@pytest.mark.stack
def test_gpt2_shape_opus_compiled_bf16_trains(train_runs) -> None:
    """gpu-gpt2 (12 × 768, T = 1024, bf16-mixed) with OPUS and compiled blocks, K = 4 of N = 8: 12 steps with every
    score finite and half kept, a finite validation bpb, and no Dynamo graph added after the first validation (step
    4: train and eval graphs compiled); prints the steady step time (steps 5-12, validation excluded) and its
    selection part, timed beside the module's other train.py runs (those of 6 steps are mostly done by then: an
    upper bound)."""
    folder, probe = _finished(train_runs, "gpt2-opus")
    assert (probe["compiled"], probe["device"], probe["precision"]) == (True, "cuda", "bf16-mixed")
    ledger = read_ledger(folder)
    assert ledger.num_rows == GPT2_STEPS * 2 * GPT2_K
    assert sum(ledger.column("selected").to_pylist()) == GPT2_STEPS * GPT2_K
    assert np.isfinite(ledger.column("score").to_numpy()).all()
    metrics = json.loads((folder / "metrics.json").read_text())
    assert metrics["global_step"] == GPT2_STEPS and math.isfinite(metrics["val_bpb"])
    graphs = [g for _, g in metrics["dynamo_graphs"]]
    assert len(graphs) == GPT2_STEPS // GPT2_VALIDATE and graphs[0] > 0 and len(set(graphs)) == 1, graphs
    (_, first, _), (_, last, _) = metrics["curve"][0], metrics["curve"][-1]
    (_, first_selection), (_, last_selection) = metrics["selection_curve"][0], metrics["selection_curve"][-1]
    steps = GPT2_STEPS - GPT2_VALIDATE
    print(f"gpu-gpt2 OPUS, compiled + bf16-mixed, K = {GPT2_K} of N = {2 * GPT2_K} at T = 1024: at most "
          f"{(last - first) / steps:.3f} s a step, {(last_selection - first_selection) / steps:.3f} s of it selection")
