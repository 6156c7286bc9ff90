"""DSIR, AutoData and DATAMASK on the sharded tables: the single-process selectors' subsets, written the same way.

    python -m selection_callbacks.offline.select dsir --pool data/default/pool.jsonl \
        --target data/default/target.jsonl --budget-tokens 2000000 --out runs/dsir/subset.parquet \
        --engine ray --workers 2 --shards 8

Per-document results do not depend on sharding, and the global steps (DSIR's target statistics and
Gumbel-top-k, k-means, the proxy, the recipe, DATAMASK's mask learning) run the single-process code
on the same inputs, so the subset file is the single-process one (DATAMASK's too, the same seed on
the same inputs; its learning is the single-process loop). Besides ``<out>.summary.json``,
``<out>.stages.json`` records seconds and peak memory per stage (driver steps) and per stage and
worker (map tasks). Shards and stage tables go to ``--work-dir`` (default ``<out>.work``); a rerun
with the same work folder resumes from the shards already written.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from selection_callbacks.core.costs import StageCosts
from selection_callbacks.core.io import write_json_atomic
from selection_callbacks.offline.autodata.evaluation import table_from_bank
from selection_callbacks.offline.autodata.search import AutoDataConfig, apply_recipe
from selection_callbacks.offline.common.corpus import Budget, Selection, SelectionError, load_corpus
from selection_callbacks.offline.common.proxy_train import ProxyConfig
from selection_callbacks.offline.common.quality import bank_quality
from selection_callbacks.offline.common.summary import SelectionRun, write_selection
from selection_callbacks.offline.datamask.selector import DatamaskConfig, mask_selection
from selection_callbacks.offline.dsir.selector import DSIRConfig, resample
from selection_callbacks.offline.sharded.bank import score_pool, sharded_bank
from selection_callbacks.offline.sharded.runner import ShardedEngine
from selection_callbacks.offline.sharded.shards import PoolShards, shard_pool
from selection_callbacks.offline.sharded.tables import TableIndex

__all__ = ["ENGINES", "EngineConfig", "SHARDED_METHODS", "run_sharded_selection"]

ENGINES = ("local", "ray")


@dataclass
class EngineConfig:
    """Where the per-document stages run.

    Attributes:
        engine: ``local`` (one process, the pool in memory: the default) or ``ray`` (Ray Data map
            tasks over parquet shards, resumable).
        workers: ray: map tasks at a time (a local cluster gets this many CPUs).
        shards: ray: parquet shards the pool is split into.
        work_dir: ray: shards, stage tables and manifests (default ``<out>.work``); reuse it to resume.
        address: ray: a running cluster's address; None starts a local one.
    """

    engine: str = "local"
    workers: int = 2
    shards: int = 8
    work_dir: str | None = None
    address: str | None = None


Sharded = Callable[[ShardedEngine, PoolShards, Any, Budget, int, Any, StageCosts, bool], tuple[TableIndex, Selection]]


def _dsir(engine: ShardedEngine, shards: PoolShards, target: Any, budget: Budget, seed: int, cfg: DSIRConfig,
          costs: StageCosts, progress: bool) -> tuple[TableIndex, Selection]:
    scored = score_pool(engine, shards, target, cfg, ProxyConfig().seq_len, costs)
    budget.check(scored.index)
    with costs.stage("select"):
        return scored.index, resample(scored.columns["dsir_logw"], scored.index.n_tokens, budget, seed)


def _autodata(engine: ShardedEngine, shards: PoolShards, target: Any, budget: Budget, seed: int,
              cfg: AutoDataConfig, costs: StageCosts, progress: bool) -> tuple[TableIndex, Selection]:
    index, bank, _ = sharded_bank(engine, shards, target, cfg.bank, costs, progress)
    budget.check(index)
    with costs.stage("select"):
        return index, apply_recipe(table_from_bank(bank, index.n_chars, index.n_tokens), budget, seed, cfg)


def _datamask(engine: ShardedEngine, shards: PoolShards, target: Any, budget: Budget, seed: int,
              cfg: DatamaskConfig, costs: StageCosts, progress: bool) -> tuple[TableIndex, Selection]:
    if cfg.quality != "features":
        raise SelectionError(f"the sharded DATAMASK reads quality from the feature bank (quality features), "
                             f"got {cfg.quality!r}; use --engine local for heuristic quality")
    if cfg.embedder != cfg.bank.embedder:
        raise SelectionError(f"the sharded DATAMASK embeds once, with hashed n-grams: set embedder and bank.embedder "
                             f"to hashed (got {cfg.embedder!r}, {cfg.bank.embedder!r})")
    index, bank, emb = sharded_bank(engine, shards, target, cfg.bank, costs, progress)
    budget.check(index)
    with costs.stage("select"):
        selection = mask_selection(bank_quality(bank), emb, index.n_tokens, budget, seed, cfg, progress)
    selection.info["embedder"] = "hashed-ngram"
    return index, selection


SHARDED_METHODS: dict[str, Sharded] = {"dsir": _dsir, "autodata": _autodata, "datamask": _datamask}


def run_sharded_selection(
    method: str, pool: str | Path, target: str | Path, budget: Budget, seed: int, out: str | Path, config: Any,
    engine_cfg: EngineConfig, progress: bool = True, after_shard: Callable[[str, int], None] | None = None,
) -> dict[str, Any]:
    """:func:`offline.select.run_selection` on the sharded path; also writes ``<out>.stages.json``."""
    if method not in SHARDED_METHODS:
        raise SelectionError(f"the sharded path runs {', '.join(SHARDED_METHODS)}, not {method!r}; "
                             "use --engine local for it")
    out = Path(out)
    work = Path(engine_cfg.work_dir) if engine_cfg.work_dir else out.with_name(f"{out.name}.work")
    start = time.perf_counter()
    costs = StageCosts()
    with costs.stage("shard the pool"):
        shards = shard_pool(pool, work / "pool", engine_cfg.shards)
    target_c = load_corpus(target, "target")
    with ShardedEngine(work, engine_cfg.workers, engine_cfg.address, progress, after_shard) as engine:
        index, selection = SHARDED_METHODS[method](engine, shards, target_c, budget, seed, config, costs, progress)
    run = SelectionRun(method, str(pool), str(target), budget, seed, config)
    summary = write_selection(run, index, selection, out, time.perf_counter() - start)
    write_json_atomic(Path(f"{out}.stages.json"), {
        "engine": {"workers": engine_cfg.workers, "shards": engine_cfg.shards, "address": engine_cfg.address,
                   "work_dir": str(work)},
        "driver": costs.as_dict(), "map_stages": engine.summary(), "seconds": summary["seconds"],
    })
    print(costs.table("sharded driver"), flush=True)
    return summary
