"""The selection ledger: DDP equals one process id for id, kill-and-resume, truncation, export → retrain.

DDP runs go through ``train.py`` in a subprocess (``strategy="ddp"`` inside pytest would relaunch
the whole session); the comparisons read the ledgers the runs wrote.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import train
from selection_callbacks.callbacks.ledger_writer import SelectionLedger
from selection_callbacks.cli.ledger import main as ledger_main
from selection_callbacks.core.ledger_store import LedgerError, read_ledger, truncate_ledger
from selection_callbacks.core.selection import SelectionRecord
from selection_callbacks.data.datamodule import PoolDataModule
from selection_callbacks.data.subset import read_subset
from selection_callbacks.methods import RandomSelection

ROOT = Path(__file__).resolve().parents[2]
# run name → method config and extra flags; the Muon runs at 1 and 2 torch threads a process
DDP_RUNS = {"random": ("random",), "high_loss": ("high_loss",), "opus": ("opus",), "opus_muon": ("opus", "--model.optimizer", "muon"),
            "opus_muon_2_threads": ("opus", "--model.optimizer", "muon"), "greats": ("greats",)}
THREADS = {"opus_muon_2_threads": 2}  # torch threads of each process of a run (1 where not named)
STEPS, K, SEQ_LEN = 6, 8, 32  # global K sequences per step: one process K, two processes K/2 each


def _args(corpus: dict[str, str], cache: Path, root: Path, method: str, batch_size: int, *extra: str) -> list[str]:
    return ["fit", "--config", str(ROOT / "configs/scale/cpu-tiny.yaml"), "--config", str(ROOT / f"configs/method/{method}.yaml"),
            "--data.pool", corpus["pool"], "--data.target", corpus["target"], "--data.val", corpus["val"],
            "--data.seq_len", str(SEQ_LEN), "--data.progress", "false", "--data.cache_dir", str(cache),
            "--data.batch_size", str(batch_size), "--data.val_samples", "16",
            "--model.config.n_layer", "2", "--model.config.n_embd", "32", "--model.config.n_head", "2",
            "--trainer.max_steps", str(STEPS), "--trainer.val_check_interval", str(STEPS),
            "--trainer.enable_progress_bar", "false", "--trainer.logger", "false",
            "--trainer.default_root_dir", str(root), *extra]


def _launch(args: list[str], log: Path, threads: int = 1) -> subprocess.Popen:
    """``python train.py ARGS`` with ``threads`` torch threads per process and tests/ importable (test-only callbacks)."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "WANDB_SILENT": "true",
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests" / "support")])}
    return subprocess.Popen([sys.executable, str(ROOT / "train.py"), *args], cwd=ROOT, env=env,
                            stdout=log.open("w"), stderr=subprocess.STDOUT)


def _wait(proc: subprocess.Popen, log: Path, expect: int = 0) -> None:
    rc = proc.wait(timeout=300)
    assert rc == expect, f"train.py exited {rc}, expected {expect}:\n{log.read_text()[-4000:]}"


@pytest.fixture(scope="module")
def runs(tiny_corpus, tmp_path_factory) -> dict[str, dict[str, Path]]:
    """For each run of ``DDP_RUNS``: a single-process run (K) and a 2-process DDP run (K/2 each) in subprocesses, each
    process at the run's ``THREADS``.

    The random DDP run also logs to W&B (offline), to check the dashboard under DDP.
    """
    root = tmp_path_factory.mktemp("ledger_runs")
    cache = tmp_path_factory.getbasetemp() / "cache"
    PoolDataModule(tiny_corpus["pool"], tiny_corpus["target"], tiny_corpus["val"], seq_len=32, cache_dir=str(cache),
                   progress=False).prepare_data()  # tokenize once, before the concurrent runs
    dirs = {m: {"single": root / f"{m}-single", "ddp": root / f"{m}-ddp"} for m in DDP_RUNS}
    wandb = ["--config", str(ROOT / "configs/logger/wandb.yaml"), "--dashboard.histogram_every", "2",
             "--trainer.logger.init_args.save_dir", str(dirs["random"]["ddp"])]
    procs = []
    for m, d in dirs.items():
        threads = THREADS.get(m, 1)
        ddp = _args(tiny_corpus, cache, d["ddp"], DDP_RUNS[m][0], K // 2, *DDP_RUNS[m][1:], "--trainer.devices", "2",
                    "--trainer.strategy", "ddp", *(wandb if m == "random" else []))
        single = _args(tiny_corpus, cache, d["single"], DDP_RUNS[m][0], K, *DDP_RUNS[m][1:])
        for args, log in ((ddp, root / f"{m}-ddp.log"), (single, root / f"{m}-single.log")):
            procs.append((_launch(args, log, threads), log))
    for proc, log in procs:
        _wait(proc, log)
    return dirs


def muon_score_tolerance(steps: np.ndarray) -> np.ndarray:
    """The bound on |score_DDP − score_single| of OPUS under Muon at each row's optimizer step (the scores are the
    calibrated utilities û = (u − ū)/σ_u, O(1) and unitless, so the bound is absolute).

    Nothing of the scoring is summed over ranks (Muon's point is the momentum each process holds, the target rows
    are every rank's), so the runs differ by the order of float32 sums only. Training sums each step's gradient in
    another order: one process reduces the K·T token terms of a weight's gradient in one pass, DDP K/2·T on each
    rank and then the two ranks' means. A sum of n = K·T float32 terms carries a rounding error of about √n·u
    relative (u = 2⁻²⁴, the unit roundoff; the terms' errors add as a random walk, Higham, *Accuracy and Stability
    of Numerical Algorithms*, §2.8). Momentum and weights sum the steps' updates, so after s steps the runs'
    weights differ by about s·√n·u relative; the scoring pass adds one more such rounding (its sums over a batch
    of another size: the target gradient's P·T ≤ K·T terms). Muon maps the momentum through Newton–Schulz, whose
    derivative has a gain of up to a^k along small singular values (the polynomial's slope a at 0 over its k
    steps: a^k ≈ 485 for torch's coefficients), so the update, the next momentum point and the utilities relative
    to their spread σ_u move by at most about (s + 1)·√n·u·a^k: the tolerance at step s (4.6e-4 a step here).
    """
    a, k = torch.optim._muon.DEFAULT_A, torch.optim._muon.DEFAULT_NS_STEPS
    return (steps + 1) * np.sqrt(K * SEQ_LEN) * np.finfo(np.float32).eps / 2 * a**k


@pytest.mark.parametrize("method", DDP_RUNS)
def test_ddp_ledger_equals_single_process(runs, method: str) -> None:
    """The DDP run's ledger is the single process's: every row, id and selection exactly; the scores within float32
    rounding (OPUS under Muon: within :func:`muon_score_tolerance` of its step, at 1 and 2 threads a process; GREATS
    relative to its scores' scale, so a step size η of one rank's K rather than the W·K rows DDP averages fails)."""
    single, ddp = read_ledger(runs[method]["single"]), read_ledger(runs[method]["ddp"])
    assert single.num_rows == ddp.num_rows == STEPS * 2 * K  # every candidate of every global superbatch
    for column in ("step", "micro_batch", "position", "sample_id", "selected", "domain"):
        assert ddp.column(column).to_pylist() == single.column(column).to_pylist(), column
    assert sum(single.column("selected").to_pylist()) == STEPS * K
    if DDP_RUNS[method][1:] == ("--model.optimizer", "muon"):
        bound = muon_score_tolerance(single.column("step").to_numpy())
        gap = np.abs(ddp.column("score").to_numpy() - single.column("score").to_numpy())
        assert (gap <= bound).all(), f"largest gap {gap.max():.3g} against a bound of {bound[gap.argmax()]:.3g} at step {gap.argmax() // (2 * K)}"
    else:
        scores = single.column("score").to_numpy()
        scale = np.abs(scores).max() if method == "greats" else 1.0  # GREATS' utilities: physical units, O(η·|g|²)
        np.testing.assert_allclose(ddp.column("score").to_numpy(), scores, rtol=1e-4, atol=1e-5 * scale)
    assert set(single.column("world_size").to_pylist()) == {1} and set(ddp.column("world_size").to_pylist()) == {2}
    assert ddp.column("rank").to_pylist() == [p // K for p in ddp.column("position").to_pylist()]  # rank r: rows r·N…
    shards = sorted(p.name for p in (runs[method]["ddp"] / "ledger").glob("*.parquet"))
    assert shards == ["rank0-00000.parquet", "rank1-00000.parquet"]  # each rank wrote its own rows, flushed at the end


def test_ddp_wandb_media_come_from_rank_zero_only(runs) -> None:
    offline = list((runs["random"]["ddp"] / "wandb").glob("offline-run-*"))
    assert len(offline) == 1  # rank 1 holds no W&B run
    tables = list((offline[0] / "files" / "media" / "table" / "selection").glob("domains_*.table.json"))
    assert len(tables) == len(range(0, STEPS, 2))


def test_summary_names_domains_and_documents(runs, capsys) -> None:
    assert ledger_main(["summary", str(runs["high_loss"]["single"]), "--bins", "3", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "domain share of the selected" in out and "prose" in out and "noise" in out
    assert "most selected by doc_id" in out and "least selected by doc_id" in out


def test_export_then_retrain_reads_exactly_those_ids(runs, tiny_corpus, tmp_path: Path) -> None:
    run = runs["high_loss"]["single"]
    out = tmp_path / "selected.parquet"
    assert ledger_main(["export", str(run), "--out", str(out)]) == 0
    table = read_ledger(run)
    chosen = Counter(table.filter(table.column("selected")).column("sample_id").to_pylist())
    subset = read_subset(out)
    assert subset.kind == "sample_id" and dict(zip(subset.ids, subset.weights.tolist())) == chosen
    # one epoch over the subset (ratio 1, every candidate kept): the retrain's ledger is the subset, counts included
    total = sum(chosen.values())
    assert total == STEPS * K and total % 16 == 0
    cli = train.main(_args(tiny_corpus, Path(os.environ["SELECTION_CACHE"]), tmp_path / "retrain", "random", 16, "--data.ratio", "1",
                           "--data.subset", str(out), "--trainer.max_steps", str(total // 16),
                           "--trainer.val_check_interval", str(total // 16)))
    assert sorted(cli.datamodule._train_ids.tolist()) == sorted(chosen)
    retrain = read_ledger(tmp_path / "retrain")
    assert Counter(retrain.column("sample_id").to_pylist()) == chosen and all(retrain.column("selected").to_pylist())


def test_kill_and_resume_ends_with_the_same_ledger_and_weights(tiny_corpus, tmp_path: Path) -> None:
    cache = Path(os.environ["SELECTION_CACHE"])
    PoolDataModule(tiny_corpus["pool"], tiny_corpus["target"], tiny_corpus["val"], seq_len=32, cache_dir=str(cache),
                   progress=False).prepare_data()

    def args(name: str, *extra: str) -> list[str]:
        return _args(tiny_corpus, cache, tmp_path / name, "high_loss", K, "--ledger.flush_every", "2",
                     "--trainer.enable_checkpointing", "true", "--trainer.callbacks+=ModelCheckpoint",
                     "--trainer.callbacks.every_n_train_steps=3", "--trainer.callbacks.save_top_k=-1",
                     f"--trainer.callbacks.dirpath={tmp_path / name / 'ckpt'}", *extra)

    full = _launch(args("full"), tmp_path / "full.log")
    killed = _launch(args("killed", "--trainer.callbacks+=kill_at_step.KillAtStep", "--trainer.callbacks.step=5"),
                     tmp_path / "killed.log")
    _wait(killed, tmp_path / "killed.log", expect=-9)
    # periodic flushes wrote step 3 and 4 after the step-3 checkpoint; the kill left them behind
    assert sorted(set(read_ledger(tmp_path / "killed").column("step").to_pylist())) == [0, 1, 2, 3, 4]
    ckpt = tmp_path / "killed" / "ckpt" / "epoch=0-step=3.ckpt"
    resumed = _launch([*args("killed"), "--ckpt_path", str(ckpt)], tmp_path / "resumed.log")
    _wait(full, tmp_path / "full.log")
    _wait(resumed, tmp_path / "resumed.log")
    a, b = read_ledger(tmp_path / "full"), read_ledger(tmp_path / "killed")
    assert a.num_rows == b.num_rows == STEPS * 2 * K
    for column in ("record", "step", "micro_batch", "sample_id", "selected", "domain"):
        assert b.column(column).to_pylist() == a.column(column).to_pylist(), column
    np.testing.assert_allclose(b.column("score").to_numpy(), a.column("score").to_numpy(), rtol=1e-5, atol=1e-6)
    final = [torch.load(tmp_path / name / "ckpt" / f"epoch=0-step={STEPS}.ckpt", weights_only=False)["state_dict"]
             for name in ("full", "killed")]
    assert final[0].keys() == final[1].keys()
    for key in final[0]:
        torch.testing.assert_close(final[1][key], final[0][key], rtol=1e-5, atol=1e-6)


# ---- unit tests: truncation, errors ----

def _record(step: int, n: int = 4) -> SelectionRecord:
    return SelectionRecord(step=step, micro_batch=step, epoch=0, world_size=1, rank_of=torch.zeros(n, dtype=torch.long),
                           scores=torch.arange(n, dtype=torch.float32), selected=torch.tensor([1, 3]),
                           sample_id=torch.arange(n) + 100 * step, domain=torch.tensor([0, 1, 0, 1]), batch={})


def _fake_trainer(root: Path, selector: RandomSelection, step: int = 0) -> SimpleNamespace:
    return SimpleNamespace(callbacks=[selector], default_root_dir=str(root), global_rank=0, world_size=1,
                           global_step=step, is_global_zero=True, datamodule=SimpleNamespace(domain_names=["a", "b"]))


def _feed(ledger: SelectionLedger, trainer: SimpleNamespace, steps: range) -> None:
    selector = trainer.callbacks[0]
    for step in steps:
        selector.last_record = _record(step)
        ledger.on_train_batch_end(trainer, None, None, {}, step)


def test_resume_truncates_rows_past_the_checkpoint(tmp_path: Path) -> None:
    selector = RandomSelection()
    trainer = _fake_trainer(tmp_path, selector)
    ledger = SelectionLedger(flush_every=3)
    ledger.setup(trainer, None, "fit")
    ledger.on_train_start(trainer, None)
    _feed(ledger, trainer, range(5))
    state = ledger.state_dict()  # checkpoint after step 4: rows 0-4 on disk
    _feed(ledger, trainer, range(5, 9))  # 5-7 flushed by flush_every, 8 only buffered when the run is killed
    assert sorted(set(read_ledger(tmp_path).column("step").to_pylist())) == list(range(8))
    (tmp_path / "ledger" / "rank0-00007.tmp123").write_bytes(b"half a shard")

    resumed = SelectionLedger(flush_every=3)
    resumed.load_state_dict(state)
    trainer.global_step = 5
    resumed.setup(trainer, None, "fit")
    resumed.on_train_start(trainer, None)
    table = read_ledger(tmp_path)
    assert sorted(set(table.column("step").to_pylist())) == [0, 1, 2, 3, 4]
    assert table.column("domain").to_pylist()[:4] == ["a", "b", "a", "b"]
    assert table.column("selected").to_pylist()[:4] == [False, True, False, True]
    assert not list((tmp_path / "ledger").glob("*.tmp*"))
    _feed(resumed, trainer, range(5, 9))
    resumed.on_train_end(trainer, None)
    assert read_ledger(tmp_path).column("step").to_pylist() == [s for s in range(9) for _ in range(4)]

    truncate_ledger(tmp_path / "ledger", 2)  # mid-shard: the shard holding records 0-2 is rewritten
    assert read_ledger(tmp_path).column("record").to_pylist() == [0] * 4 + [1] * 4
    truncate_ledger(tmp_path / "ledger", 0)
    assert not list((tmp_path / "ledger").glob("*.parquet"))


def test_fresh_run_replaces_an_earlier_ledger(tmp_path: Path) -> None:
    selector = RandomSelection()
    trainer = _fake_trainer(tmp_path, selector)
    first = SelectionLedger(flush_every=1)
    first.setup(trainer, None, "fit")
    first.on_train_start(trainer, None)
    _feed(first, trainer, range(3))
    second = SelectionLedger()
    second.setup(trainer, None, "fit")
    with pytest.warns(UserWarning, match="earlier run"):
        second.on_train_start(trainer, None)
    _feed(second, trainer, range(2))
    second.on_train_end(trainer, None)
    assert read_ledger(tmp_path).column("step").to_pylist() == [0] * 4 + [1] * 4


def test_ledger_without_selector_warns_and_records_nothing(tmp_path: Path) -> None:
    trainer = _fake_trainer(tmp_path, RandomSelection())
    trainer.callbacks = []
    ledger = SelectionLedger()
    with pytest.warns(UserWarning, match="no SelectionCallback"):
        ledger.setup(trainer, None, "fit")
    ledger.on_train_start(trainer, None)
    ledger.on_train_batch_end(trainer, None, None, {}, 0)
    assert ledger.state_dict() == {"records": 0} and not (tmp_path / "ledger").exists()


def test_unreadable_ledgers_raise_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(LedgerError, match="no ledger"):
        read_ledger(tmp_path)
    (tmp_path / "ledger").mkdir()
    (tmp_path / "ledger" / "rank0-00000.parquet").write_bytes(b"not parquet")
    with pytest.raises(LedgerError, match="cannot read ledger shard"):
        read_ledger(tmp_path)
    pq.write_table(pa.table({"step": [0]}), tmp_path / "ledger" / "rank0-00000.parquet")
    with pytest.raises(LedgerError, match="has columns"):
        read_ledger(tmp_path)
    assert ledger_main(["export", str(tmp_path), "--out", str(tmp_path / "subset.jsonl")]) == 1
