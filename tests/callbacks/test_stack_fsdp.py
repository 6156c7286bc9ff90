"""FSDP2 on two CPU processes (gloo): every online method's ledger equals DDP's, through a kill and a resume and
under gradient accumulation; OPUS under Muon and FSDP2 is refused.

Each run is ``train.py`` under ``ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)`` in a
subprocess (a distributed strategy inside pytest would relaunch the session), K/2 rows per rank, compared
with the same run under ``strategy=ddp``. The two strategies run the same arithmetic but for the gradient
reduction: DDP all-reduces each gradient and averages, FSDP2 reduce-scatters the average into row shards
and steps AdamW on the shards (elementwise, so sharding does not change the update); the forward runs on
all-gathered copies of the same weights. With two ranks the reduction is one addition, a + b = b + a
exactly in whichever order gloo adds, and one halving, exact in binary floating point, so the weights,
and the scores read from them, are bitwise those of DDP. The ghost methods (OPUS, GREATS) add nothing
reduced: each rank scores its own candidate and target rows through the all-gathered weights (the scoring
backward differentiates the captured activations and writes no ``.grad``, so FSDP2 reduce-scatters
nothing in it), and OPUS all-gathers each scored layer's AdamW moments whole (concatenated shards, exact).
So the scores are compared for equality, as are sample ids and selections (more ranks would add in a
varying order and need a tolerance).

The runs take 8 steps with a validation after step 4 (FSDP2 leaves the root unit unsharded after a
forward without backward, which the ghost engine must see through); OPUS scores the head and the embedding
too (parameters of the root unit) and checkpoints every 2 steps (``last.ckpt``). One more OPUS run under
FSDP2 loses rank 1 to SIGKILL at step 5, stops (rank 0 loses its peer), and resumes from ``last.ckpt``.
The accumulation runs take 4 steps of 2 micro-batches. One more run per method, FSDP2 with a compiled learner
and bf16-mixed, trains to the end with finite scores that rank as DDP fp32's.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from scipy.stats import spearmanr

from selection_callbacks.core.ledger_store import read_ledger
from selection_callbacks.data.datamodule import PoolDataModule
from tests.callbacks.test_ledger import ROOT, K, _args

STEPS, ACCUMULATE = 8, 2  # steps of the comparison runs; micro-batches per step of the accumulation runs
CONCURRENT, TIMEOUT = 8, 600  # runs at once (two processes each); seconds a run may take
FSDP2 = ["--trainer.devices", "2", "--trainer.strategy", "lightning.pytorch.strategies.ModelParallelStrategy",
         "--trainer.strategy.data_parallel_size", "2", "--trainer.strategy.tensor_parallel_size", "1"]
DDP = ["--trainer.devices", "2", "--trainer.strategy", "ddp"]
COMMON = ["--trainer.max_steps", str(STEPS), "--trainer.val_check_interval", "4"]
PROXY = ["--selection.init_args.proxy_layers", "1", "--selection.init_args.proxy_width", "32",
         "--selection.init_args.proxy_heads", "2", "--selection.init_args.reference_steps", "3",
         "--selection.init_args.reference_batch_size", "4"]
OPUS = ["--selection.init_args.include_head", "true", "--selection.init_args.include_embedding", "true",
        "--ledger.flush_every", "1", "--trainer.enable_checkpointing", "true", "--trainer.callbacks+=ModelCheckpoint",
        "--trainer.callbacks.every_n_train_steps=2", "--trainer.callbacks.save_last=true"]
METHODS = {  # method → its flags in every run
    "random": [], "high_loss": [], "oracle": [], "rho": [*PROXY, "--selection.init_args.score_len", "16"],
    "classact": PROXY, "opus": OPUS, "greats": [],
}
ACCUMULATED = ["greats", "high_loss"]
FULL_STACK = ["--model.compile", "true", "--trainer.precision", "bf16-mixed"]  # with FSDP2
KILL_STEP = 5


@dataclass
class Run:
    """One ``train.py`` launch writing to ``root/<folder>``: its method, flags, expected exit code and the run to
    launch once it has ended."""

    folder: str
    method: str
    flags: list[str]
    expect: int = 0
    then: Run | None = None


def _runs(root: Path) -> dict[str, Run]:
    """Every run of the module by its log's name, the longest chains first; the resume follows the killed run, into
    its folder (checkpoints go to ``<folder>/checkpoints``: no logger)."""
    runs = {f"{m}-compiled-bf16-fsdp2": Run(f"{m}-compiled-bf16-fsdp2", m, [*flags, *COMMON, *FSDP2, *FULL_STACK])
            for m, flags in METHODS.items()}
    opus = [*OPUS, *COMMON, *FSDP2]
    resumed = Run("opus-killed", "opus", [*opus, "--ckpt_path", str(root / "opus-killed" / "checkpoints" / "last.ckpt")])
    kill = ["--trainer.callbacks+=kill_at_step.KillAtStep", f"--trainer.callbacks.step={KILL_STEP}", "--trainer.callbacks.rank=1"]
    runs["opus-killed"] = Run("opus-killed", "opus", [*opus, *kill], expect=1, then=resumed)  # rank 0 exits 1: its peer is lost
    accumulate = ["--trainer.accumulate_grad_batches", str(ACCUMULATE), "--trainer.max_steps", str(STEPS // ACCUMULATE)]
    for s, strategy in (("fsdp2", FSDP2), ("ddp", DDP)):
        runs |= {f"{m}-{s}": Run(f"{m}-{s}", m, [*flags, *COMMON, *strategy]) for m, flags in METHODS.items()}
        runs |= {f"{m}-accumulate-{s}": Run(f"{m}-accumulate-{s}", m, [*METHODS[m], *COMMON, *accumulate, *strategy])
                 for m in ACCUMULATED}
    runs["opus-muon-fsdp2"] = Run("opus-muon-fsdp2", "opus", ["--model.optimizer", "muon", *COMMON, *FSDP2], expect=1)
    return runs


def _launch(args: list[str], log: Path) -> subprocess.Popen:
    """``python train.py ARGS`` as :func:`tests.callbacks.test_ledger._launch`, in a session of its own (its ranks
    are stopped together)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_SILENT": "true",
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests" / "support")])}
    return subprocess.Popen([sys.executable, str(ROOT / "train.py"), *args], cwd=ROOT, env=env, stdout=log.open("w"),
                            stderr=subprocess.STDOUT, start_new_session=True)


def _stop(proc: subprocess.Popen) -> None:
    """SIGKILL every process of a run's session (a rank that outlives rank 0, blocked on a lost peer)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _run_all(runs: dict[str, Run], corpus: dict[str, str], cache: Path, root: Path) -> dict[str, list[int]]:
    """Every run, ``CONCURRENT`` at once, each stopped after ``TIMEOUT`` s; a run's ``then`` starts when it ends (log
    ``<name>-then.log``). Returns the steps each ``then``-run's folder held before it started."""
    queue, running, seen = list(runs.items()), {}, {}
    try:
        while queue or running:
            while queue and len(running) < CONCURRENT:
                name, run = queue.pop(0)
                args = _args(corpus, cache, root / run.folder, run.method, K // 2, *run.flags)
                running[name] = (run, _launch(args, root / f"{name}.log"), time.monotonic())
            time.sleep(0.5)
            for name, (run, proc, start) in list(running.items()):
                if proc.poll() is None and time.monotonic() - start < TIMEOUT:
                    continue
                del running[name]
                _stop(proc)
                log = (root / f"{name}.log").read_text()[-4000:]
                assert proc.returncode == run.expect, f"{name}: exit {proc.returncode}, expected {run.expect}:\n{log}"
                if run.then is not None:
                    seen[name] = sorted(set(read_ledger(root / run.folder).column("step").to_pylist()))
                    queue.insert(0, (f"{name}-then", run.then))
    finally:
        for _, proc, _ in running.values():
            _stop(proc)
    return seen


@pytest.fixture(scope="module")
def runs(tiny_corpus, tmp_path_factory) -> dict:
    """Every run of :func:`_runs`: the runs' root folder and the steps the killed run's ledger held."""
    root = tmp_path_factory.mktemp("stack_runs")
    cache = tmp_path_factory.getbasetemp() / "cache"
    PoolDataModule(tiny_corpus["pool"], tiny_corpus["target"], tiny_corpus["val"], seq_len=32, cache_dir=str(cache),
                   progress=False).prepare_data()  # tokenize once, before the concurrent runs
    seen = _run_all(_runs(root), tiny_corpus, cache, root)
    return {"root": root, "killed_steps": seen["opus-killed"]}


def _assert_same_ledger(a: Path, b: Path, rows: int) -> None:
    """Ledgers ``a`` and ``b``: ``rows`` rows, the same ids, positions, ranks and selections, bitwise the same scores."""
    x, y = read_ledger(a), read_ledger(b)
    assert x.num_rows == y.num_rows == rows  # every candidate of every global superbatch
    for column in ("record", "step", "micro_batch", "position", "rank", "world_size", "sample_id", "selected"):
        assert x.column(column).to_pylist() == y.column(column).to_pylist(), column
    np.testing.assert_array_equal(x.column("score").to_numpy(), y.column("score").to_numpy())
    assert sum(x.column("selected").to_pylist()) == rows // 2


@pytest.mark.parametrize("method", METHODS)
def test_fsdp2_ledger_equals_ddp(runs, method: str) -> None:
    _assert_same_ledger(runs["root"] / f"{method}-fsdp2", runs["root"] / f"{method}-ddp", STEPS * 2 * K)


def accumulation_tolerance(steps: np.ndarray) -> np.ndarray:
    """The bound on |score_FSDP2 − score_DDP| relative to the record's largest |score_DDP| under gradient accumulation
    (2 micro-batches a step), at the optimizer step s each row was scored after.

    The strategies reduce in different orders here. DDP accumulates each rank's micro-batch gradients locally and
    all-reduces their sum on the last micro-batch, ((a₁ + a₂) + (b₁ + b₂))/2; FSDP2 reduce-scatters every
    micro-batch and accumulates the shards, (a₁ + b₁)/2 + (a₂ + b₂)/2. Each side is three float32 additions of the
    same four terms (the halvings are exact), within 2u·Σ|t| of the exact sum (u = 2⁻²⁴, the unit roundoff;
    pairwise summation of 4 terms, Higham, *Accuracy and Stability of Numerical Algorithms*, §4.2), so the sides
    differ by at most 4u·Σ|t| a step. AdamW's update m̂/(√v̂ + ε) is homogeneous of degree 0 in the gradients, so it
    carries that relative change into the weights, and after s steps they differ by about 4·s·u relative; the
    scores, smooth functions of the weights, move by as much relative to their scale, plus their own last
    rounding (one ulp: high_loss's losses differ by exactly one). Entries whose terms partly cancel have
    Σ|t| above |Σt|: a factor 2 of headroom gives 8·(s + 1)·u. Before the first step (s = 0) nothing differs and
    the scores are compared for equality.
    """
    return np.where(steps == 0, 0.0, 8 * (steps + 1) * np.finfo(np.float32).eps / 2)


@pytest.mark.parametrize("method", ACCUMULATED)
def test_fsdp2_gradient_accumulation_ledger_equals_ddp(runs, method: str) -> None:
    """Two micro-batches a step, each selected: the same ids and selections as DDP's, the scores within
    :func:`accumulation_tolerance` (bitwise before the first step)."""
    fsdp2, ddp = (read_ledger(runs["root"] / f"{method}-accumulate-{s}") for s in ("fsdp2", "ddp"))
    assert fsdp2.num_rows == ddp.num_rows == STEPS * 2 * K
    for column in ("record", "step", "micro_batch", "position", "rank", "sample_id", "selected"):
        assert fsdp2.column(column).to_pylist() == ddp.column(column).to_pylist(), column
    assert sorted(set(fsdp2.column("step").to_pylist())) == list(range(STEPS // ACCUMULATE))
    records, steps = fsdp2.column("record").to_numpy(), fsdp2.column("step").to_numpy()
    x, y = fsdp2.column("score").to_numpy(), ddp.column("score").to_numpy()
    scale = np.array([np.abs(y[records == r]).max() for r in records])
    gap, bound = np.abs(x - y) / scale, accumulation_tolerance(steps)
    assert (gap <= bound).all(), f"largest relative gap {gap.max():.3g} against a bound of {bound[gap.argmax()]:.3g}"


def test_fsdp2_kill_one_rank_then_resume_gives_the_uninterrupted_ledger(runs) -> None:
    """Rank 1 SIGKILLed at step 5; its ledger held step 4, past ``last.ckpt`` (step 4); the resumed run's ledger
    is the uninterrupted run's, row for row and bit for bit."""
    assert runs["killed_steps"] == list(range(KILL_STEP))
    _assert_same_ledger(runs["root"] / "opus-killed", runs["root"] / "opus-fsdp2", STEPS * 2 * K)


def test_opus_under_muon_and_fsdp2_is_refused(runs) -> None:
    log = (runs["root"] / "opus-muon-fsdp2.log").read_text()
    assert "LitGPT: Muon does not run under FSDP2: its Newton-Schulz orthogonalisation needs each hidden matrix whole" in log


@pytest.mark.parametrize("method", METHODS)
def test_compiled_bf16_fsdp2_ranks_as_ddp_fp32(runs, method: str) -> None:
    """The full stack trains to the end; each step's scores are finite and rank as DDP fp32's (Spearman ≥ 0.9;
    scores constant within a step, as the oracle's can be, equal)."""
    full, ddp = read_ledger(runs["root"] / f"{method}-compiled-bf16-fsdp2"), read_ledger(runs["root"] / f"{method}-ddp")
    assert full.column("sample_id").to_pylist() == ddp.column("sample_id").to_pylist()
    scores, reference = full.column("score").to_numpy(), ddp.column("score").to_numpy()
    assert np.isfinite(scores).all()
    for step in range(STEPS):
        rows = slice(step * 2 * K, (step + 1) * 2 * K)
        if np.ptp(reference[rows]) == 0:
            np.testing.assert_array_equal(scores[rows], reference[rows])
        else:
            assert spearmanr(scores[rows], reference[rows]).statistic >= 0.9, step
