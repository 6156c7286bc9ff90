"""FSDP2 on two CPU processes (gloo): the ledgers of random and RHO-LOSS (windows) equal DDP's; OPUS is refused.

Each run is ``train.py`` under ``ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)`` in a
subprocess (a distributed strategy inside pytest would relaunch the session), K/2 rows per rank, compared
with the same run under ``strategy=ddp``. The two strategies run the same arithmetic but for the gradient
reduction: DDP all-reduces each gradient and averages, FSDP2 reduce-scatters the average into row shards
and steps AdamW on the shards (elementwise, so sharding does not change the update); the forward runs on
all-gathered copies of the same weights. With two ranks the reduction is one addition, a + b = b + a
exactly in whichever order gloo adds, and one halving, exact in binary floating point, so the weights,
and the scores read from them, are bitwise those of DDP: the scores are compared for equality, as are
sample ids and selections (more ranks would add in a varying order and need a tolerance).
One more run, RHO-LOSS under FSDP2 with a compiled learner and bf16-mixed, trains to the end with finite
scores that rank as DDP fp32's.
"""

from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import spearmanr

from selection_callbacks.core.ledger_store import read_ledger
from selection_callbacks.data.datamodule import PoolDataModule
from tests.callbacks.test_ledger import K, STEPS, _args, _launch, _wait

FSDP2 = ["--trainer.devices", "2", "--trainer.strategy", "lightning.pytorch.strategies.ModelParallelStrategy",
         "--trainer.strategy.data_parallel_size", "2", "--trainer.strategy.tensor_parallel_size", "1"]
DDP = ["--trainer.devices", "2", "--trainer.strategy", "ddp"]
RHO = ["--selection.init_args.reference_steps", "5", "--selection.init_args.score_len", "16"]
RUNS = {  # run name → method config and flags
    "random-fsdp2": ("random", *FSDP2), "random-ddp": ("random", *DDP),
    "rho-fsdp2": ("rho", *RHO, *FSDP2), "rho-ddp": ("rho", *RHO, *DDP),
    "rho-compiled-bf16-fsdp2": ("rho", *RHO, *FSDP2, "--model.compile", "true", "--trainer.precision", "bf16-mixed"),
    "opus-fsdp2": ("opus", *FSDP2),
}


@pytest.fixture(scope="module")
def runs(tiny_corpus, tmp_path_factory) -> dict:
    """Every run of ``RUNS`` at once (two processes each); the run folders. OPUS must exit 1."""
    root = tmp_path_factory.mktemp("stack_runs")
    cache = tmp_path_factory.getbasetemp() / "cache"
    PoolDataModule(tiny_corpus["pool"], tiny_corpus["target"], tiny_corpus["val"], seq_len=32, cache_dir=str(cache),
                   progress=False).prepare_data()  # tokenize once, before the concurrent runs
    procs = {name: _launch(_args(tiny_corpus, cache, root / name, method, K // 2, *flags), root / f"{name}.log")
             for name, (method, *flags) in RUNS.items()}
    for name, proc in procs.items():
        _wait(proc, root / f"{name}.log", expect=1 if name == "opus-fsdp2" else 0)
    return {name: root / name for name in RUNS} | {"opus-log": root / "opus-fsdp2.log"}


@pytest.mark.parametrize("method", ["random", "rho"])
def test_fsdp2_ledger_equals_ddp(runs, method: str) -> None:
    fsdp2, ddp = read_ledger(runs[f"{method}-fsdp2"]), read_ledger(runs[f"{method}-ddp"])
    assert fsdp2.num_rows == ddp.num_rows == STEPS * 2 * K  # every candidate of every global superbatch
    for column in ("step", "position", "rank", "world_size", "sample_id", "selected"):
        assert fsdp2.column(column).to_pylist() == ddp.column(column).to_pylist(), column
    np.testing.assert_array_equal(fsdp2.column("score").to_numpy(), ddp.column("score").to_numpy())
    assert sum(fsdp2.column("selected").to_pylist()) == STEPS * K


def test_compiled_bf16_fsdp2_rho_ranks_as_ddp_fp32(runs) -> None:
    """The full stack trains to the end; each step's scores are finite and rank as DDP fp32's (Spearman ≥ 0.9)."""
    full, ddp = read_ledger(runs["rho-compiled-bf16-fsdp2"]), read_ledger(runs["rho-ddp"])
    assert full.column("sample_id").to_pylist() == ddp.column("sample_id").to_pylist()
    scores, reference = full.column("score").to_numpy(), ddp.column("score").to_numpy()
    assert np.isfinite(scores).all()
    for step in range(STEPS):
        rows = slice(step * 2 * K, (step + 1) * 2 * K)
        assert spearmanr(scores[rows], reference[rows]).statistic >= 0.9, step


def test_opus_refused_under_fsdp2(runs) -> None:
    log = runs["opus-log"].read_text()
    assert "OPUSSelection does not run under FSDP2 (DTensor parameter shards under ModelParallelStrategy)" in log
