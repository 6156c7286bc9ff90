"""The sharded path (Ray Data, 2 local workers) writes the single-process subsets on the default corpus, and resumes."""

from __future__ import annotations

import contextlib
import filecmp
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from selection_callbacks.core.costs import StageCosts
from selection_callbacks.data.default_corpus import build_default_corpus
from selection_callbacks.offline.autodata.search import AutoDataConfig
from selection_callbacks.offline.common.corpus import Budget, load_corpus
from selection_callbacks.offline.common.features import FeatureConfig, compute_features
from selection_callbacks.offline.common.proxy_train import ProxyConfig
from selection_callbacks.offline.datamask.selector import DatamaskConfig
from selection_callbacks.offline.dsir.selector import DSIRConfig
from selection_callbacks.offline.select import main, run_selection
from selection_callbacks.offline.sharded.bank import sharded_bank
from selection_callbacks.offline.sharded.runner import ShardedEngine
from selection_callbacks.offline.sharded.select import EngineConfig, run_sharded_selection
from selection_callbacks.offline.sharded.shards import shard_pool

ray = pytest.importorskip("ray")

# the shipped recipe's bank, with a proxy small enough for a test: 200k training tokens, 64 scored per document
SMALL_BANK = FeatureConfig(proxy=ProxyConfig(n_layer=1, n_head=2, n_embd=32, seq_len=64, batch_size=16, lr=1e-2),
                           proxy_tokens=200_000, score_tokens=64, clusters=4, dsir=DSIRConfig(num_buckets=2048))
BUDGET = Budget(tokens=2_000_000)
SMALL_MASK = DatamaskConfig(bank=SMALL_BANK, embedder="hashed", iterations=50, groups=16)


@pytest.fixture(scope="module")
def default_corpus(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    out = tmp_path_factory.mktemp("default")
    build_default_corpus(out, seed=0)
    return {"pool": str(out / "pool.jsonl"), "target": str(out / "target.jsonl")}


@pytest.fixture(scope="module")
def local_ray():
    """One local 2-CPU cluster for the module (nothing downloaded, no dashboard), shut down at its end."""
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def _both(method: str, corpus: dict[str, str], config, tmp_path: Path, seed: int = 0) -> tuple[Path, Path]:
    local, sharded = tmp_path / f"{method}-local.parquet", tmp_path / f"{method}-ray.parquet"
    run_selection(method, corpus["pool"], corpus["target"], BUDGET, seed, local, config, progress=False)
    run_sharded_selection(method, corpus["pool"], corpus["target"], BUDGET, seed, sharded, config,
                          EngineConfig("ray", workers=2, shards=5, work_dir=str(tmp_path / "work")), progress=False)
    return local, sharded


def _ids(path: Path) -> set[str]:
    return set(pq.read_table(path).column("doc_id").to_pylist())


def test_dsir_sharded_writes_the_single_process_subset(default_corpus, local_ray, tmp_path) -> None:
    local, sharded = _both("dsir", default_corpus, DSIRConfig(), tmp_path)
    assert filecmp.cmp(local, sharded, shallow=False)
    stages = json.loads(Path(f"{sharded}.stages.json").read_text())
    assert set(stages["map_stages"]) == {"count", "score"}
    for stage in stages["map_stages"].values():
        assert stage["shards_computed"] == 5 and sum(w["shards"] for w in stage["workers"].values()) == 5
        assert all(w["peak_rss_mb"] > 0 and w["rows"] > 0 for w in stage["workers"].values())
    assert "select" in stages["driver"]


def test_autodata_shipped_recipe_sharded_writes_the_single_process_subset(default_corpus, local_ray, tmp_path) -> None:
    local, sharded = _both("autodata", default_corpus, AutoDataConfig(recipe="autodata_best", bank=SMALL_BANK), tmp_path)
    assert filecmp.cmp(local, sharded, shallow=False)


def test_sharded_bank_columns_equal_the_single_process_bank(default_corpus, local_ray, tmp_path) -> None:
    pool, target = load_corpus(default_corpus["pool"]), load_corpus(default_corpus["target"])
    ref = compute_features(pool, target, SMALL_BANK, progress=False)
    with ShardedEngine(tmp_path / "work", workers=2, progress=False) as engine:
        index, bank, _ = sharded_bank(engine, shard_pool(default_corpus["pool"], tmp_path / "work" / "pool", 3),
                                      target, SMALL_BANK, StageCosts(), progress=False)
    np.testing.assert_array_equal(index.ids, pool.ids)
    assert set(bank.columns) == set(ref.columns)
    for name, column in ref.columns.items():
        if name == "log_freq":  # a matrix-vector product: BLAS blocking moves the last bit with the row count
            np.testing.assert_allclose(bank.columns[name], column, rtol=1e-13, atol=0)
        else:
            np.testing.assert_array_equal(bank.columns[name], column, err_msg=name)


def test_datamask_sharded_is_within_its_seed_variation(default_corpus, local_ray, tmp_path) -> None:
    local, sharded = _both("datamask", default_corpus, SMALL_MASK, tmp_path)
    other_seed = tmp_path / "datamask-seed1.parquet"
    run_selection("datamask", default_corpus["pool"], default_corpus["target"], BUDGET, 1, other_seed, SMALL_MASK,
                  progress=False)
    a, b, c = _ids(local), _ids(sharded), _ids(other_seed)
    assert len(a & b) / len(a | b) >= len(a & c) / len(a | c)


def test_a_crashed_sharded_run_resumes_to_the_uninterrupted_subset(default_corpus, local_ray, tmp_path) -> None:
    """A crash after two shards of ``score`` (count done), then a rerun: only the missing shards are computed."""
    whole = tmp_path / "whole.parquet"
    engine = EngineConfig("ray", workers=2, shards=6, work_dir=str(tmp_path / "whole-work"))
    run_sharded_selection("dsir", default_corpus["pool"], default_corpus["target"], BUDGET, 3, whole, DSIRConfig(),
                          engine, progress=False)

    def crash(stage: str, shard: int, seen: list[int] = []) -> None:
        seen.append(shard)
        if stage == "score" and len(seen) == 6 + 2:
            raise KeyboardInterrupt("killed")

    resumed = tmp_path / "resumed.parquet"
    engine = EngineConfig("ray", workers=2, shards=6, work_dir=str(tmp_path / "work"))
    with pytest.raises(KeyboardInterrupt):
        run_sharded_selection("dsir", default_corpus["pool"], default_corpus["target"], BUDGET, 3, resumed,
                              DSIRConfig(), engine, progress=False, after_shard=crash)
    assert not resumed.exists()
    [score_manifest] = (tmp_path / "work").glob("score-*/manifest.json")
    assert len(json.loads(score_manifest.read_text())["shards"]) == 2
    run_sharded_selection("dsir", default_corpus["pool"], default_corpus["target"], BUDGET, 3, resumed, DSIRConfig(),
                          engine, progress=False)
    assert filecmp.cmp(whole, resumed, shallow=False)
    stages = json.loads(Path(f"{resumed}.stages.json").read_text())["map_stages"]
    assert (stages["count"]["shards_computed"], stages["count"]["shards_reused"]) == (0, 6)
    assert (stages["score"]["shards_computed"], stages["score"]["shards_reused"]) == (4, 2)


def _manifest_counts(work: Path) -> dict[str, int]:
    """Shards each map stage's manifest records (written atomically), by stage name (``count``, ``score``)."""
    return {m.parent.name.rsplit("-", 1)[0]: len(json.loads(m.read_text())["shards"])
            for m in work.glob("*-*/manifest.json")}


def _processes_with_env(entry: str) -> list[int]:
    """Pids of this user's processes whose environment holds ``entry`` (``NAME=value``)."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and entry.encode() in (proc / "environ").read_bytes().split(b"\0"):
                pids.append(int(proc.name))
        except OSError:  # gone, or another user's
            continue
    return pids


def _wait_gone(entry: str, timeout: float) -> list[int]:
    """Waits until no process holds ``entry`` in its environment; the stragglers at ``timeout`` (SIGKILLed)."""
    deadline = time.monotonic() + timeout
    while (left := _processes_with_env(entry)) and time.monotonic() < deadline:
        time.sleep(0.2)
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return left


def test_a_sigkilled_sharded_run_resumes_to_the_uninterrupted_subset(default_corpus, local_ray, tmp_path) -> None:
    """``select dsir --engine ray`` in a child process, SIGKILLed (its process group) once ``count`` has written
    some but not all of its 12 shards; its Ray processes end with it, and rerunning the same command computes only
    the missing shards and writes the uninterrupted run's subset byte for byte.

    The child starts its own local cluster under a temporary ``RAY_TMPDIR``, which every Ray process it spawns
    inherits, so the test finds (and on failure kills) exactly that cluster's processes and no other.
    """
    shards, work, out = 12, tmp_path / "work", tmp_path / "subset.parquet"
    args = ["dsir", "--pool", default_corpus["pool"], "--target", default_corpus["target"], "--budget-tokens",
            "2000000", "--seed", "3", "--engine", "ray", "--workers", "2", "--shards", str(shards), "--progress",
            "false"]
    main([*args, "--out", str(tmp_path / "whole.parquet"), "--work-dir", str(tmp_path / "whole-work")])

    with tempfile.TemporaryDirectory(prefix="ray-kill-", ignore_cleanup_errors=True) as ray_tmp:
        marker = f"RAY_TMPDIR={ray_tmp}"
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        env |= {"RAY_TMPDIR": ray_tmp, "PYTHONPATH": os.pathsep.join(
            [str(Path(__file__).resolve().parents[2]), *filter(None, [os.environ.get("PYTHONPATH")])])}
        command = [sys.executable, "-m", "selection_callbacks", "select", *args, "--out", str(out),
                   "--work-dir", str(work)]
        log = tmp_path / "killed.log"
        try:
            with log.open("wb") as sink:
                child = subprocess.Popen(command, env=env, stdout=sink, stderr=subprocess.STDOUT,
                                         start_new_session=True)
            try:
                deadline = time.monotonic() + 120
                while not 0 < (seen := _manifest_counts(work)).get("count", 0) < shards:
                    if child.poll() is not None or time.monotonic() > deadline or seen.get("count") == shards:
                        pytest.fail(f"never saw count part-written (manifests {seen}, exit {child.poll()}); "
                                    f"log tail:\n{log.read_text()[-2000:]}")
                    time.sleep(0.01)
            finally:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(child.pid, signal.SIGKILL)
                child.wait()
            assert not (left := _wait_gone(marker, 30)), f"Ray processes {left} outlived the killed run"
            assert not out.exists()
            before = _manifest_counts(work)
            assert 0 < sum(before.values()) < 2 * shards, before

            # a hang guard only: on a loaded 2-core host the rerun has taken over 120 s
            rerun = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600,
                                   start_new_session=True)
            assert rerun.returncode == 0, rerun.stdout[-2000:] + rerun.stderr[-2000:]
            assert not (left := _wait_gone(marker, 30)), f"Ray processes {left} outlived the rerun"
        finally:
            _wait_gone(marker, 0)  # what a failed step left of this run's cluster

    assert filecmp.cmp(tmp_path / "whole.parquet", out, shallow=False)
    stages = json.loads(Path(f"{out}.stages.json").read_text())["map_stages"]
    for stage in ("count", "score"):
        reused = before.get(stage, 0)
        assert (stages[stage]["shards_reused"], stages[stage]["shards_computed"]) == (reused, shards - reused), stage


def test_cli_engine_ray_and_its_errors(default_corpus, local_ray, tmp_path) -> None:
    common = ["--pool", default_corpus["pool"], "--target", default_corpus["target"], "--budget-docs", "50",
              "--progress", "false"]
    main(["dsir", *common, "--out", str(tmp_path / "local.parquet")])
    main(["dsir", *common, "--out", str(tmp_path / "ray.parquet"), "--engine", "ray", "--workers", "2", "--shards", "3"])
    assert filecmp.cmp(tmp_path / "local.parquet", tmp_path / "ray.parquet", shallow=False)
    assert (tmp_path / "ray.parquet.work" / "pool" / "shard-00002.parquet").exists()
    with pytest.raises(ValueError, match="more than the pool's"):
        shard_pool(default_corpus["pool"], tmp_path / "too-many", 10**6)
    with pytest.raises(ValueError, match="another pool or shard count"):
        shard_pool(default_corpus["pool"], tmp_path / "ray.parquet.work" / "pool", 4)
    with pytest.raises(ValueError, match="embeds once, with hashed n-grams"):
        run_sharded_selection("datamask", default_corpus["pool"], default_corpus["target"], BUDGET, 0,
                              tmp_path / "m.parquet", DatamaskConfig(bank=SMALL_BANK, embedder="minilm"),
                              EngineConfig("ray", shards=3, work_dir=str(tmp_path / "ray.parquet.work")), False)
