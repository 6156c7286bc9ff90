"""One command for every offline selector: pool + target → a subset file the pool datamodule trains on.

    python -m selection_callbacks.offline.select dsir --pool data/default/pool.jsonl \
        --target data/default/target.jsonl --budget-tokens 2000000 --seed 0 --out runs/dsir/subset.parquet
    python -m selection_callbacks.offline.select warmup_delta ... --trim_low 2 --trim_high 2
    python -m selection_callbacks.offline.select policy ... --rounds 20 --group_size 8 --workers 2
    python -m selection_callbacks.offline.select autodata ... --recipe runs/autodata/best_recipe.json
    python -m selection_callbacks.offline.select policy --help      # every option of one method

Budget: ``--budget-docs N`` keeps exactly N documents; ``--budget-tokens B`` keeps the fewest
top-ranked documents holding ≥ B ByteTokenizer tokens (UTF-8 bytes + 1 per document). The subset
(parquet, ``doc_id`` column) trains with ``--data.subset``; ``<out>.summary.json`` records what was
chosen (domain composition, length quantiles), the settings, the method's details and the seconds,
and the same summary is printed. Selectors read the pool and the *target* split, never val.

Adding a selector: a folder ``offline/<name>/`` with ``selector.py`` holding ``fn(pool: Corpus,
target: Corpus, budget: Budget, seed: int, config, progress: bool) -> Selection`` and its dataclass
``config`` (its documented fields become the method's options), an ``__init__.py`` exporting both and a
card ``README.md``; then add ``Selector(config, fn, help)`` to :data:`SELECTORS`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from jsonargparse import ActionSubCommands, ArgumentParser, Namespace

from selection_callbacks.core.arguments import add_pool_arguments, command_parser
from selection_callbacks.offline.autodata import AutoDataConfig, select_autodata
from selection_callbacks.offline.common.corpus import Budget, Corpus, Selection, SelectionError, load_corpus
from selection_callbacks.offline.common.summary import SelectionRun, write_selection
from selection_callbacks.offline.datamask import DatamaskConfig, select_datamask
from selection_callbacks.offline.dsir import DSIRConfig, select_dsir
from selection_callbacks.offline.oracle import OracleConfig, select_oracle
from selection_callbacks.offline.policy import PolicyConfig, select_policy
from selection_callbacks.offline.sharded.select import ENGINES, SHARDED_METHODS, EngineConfig, run_sharded_selection
from selection_callbacks.offline.warmup_delta import WarmupDeltaConfig, select_warmup_delta


@dataclass(frozen=True)
class Selector:
    """A registered offline selector: its config dataclass, its function and a one-line help."""

    config: type
    select: Callable[[Corpus, Corpus, Budget, int, Any, bool], Selection]
    help: str


SELECTORS: dict[str, Selector] = {
    "dsir": Selector(DSIRConfig, select_dsir, "DSIR: hashed n-gram importance resampling toward the target"),
    "warmup_delta": Selector(
        WarmupDeltaConfig, select_warmup_delta, "warmup delta: top Δ = ℓ_early − ℓ_final of a pool proxy, tails trimmed"
    ),
    "policy": Selector(
        PolicyConfig, select_policy, "learned linear policy over the feature bank, REINFORCE on proxy rewards"
    ),
    "datamask": Selector(
        DatamaskConfig, select_datamask, "DATAMASK: policy-gradient mask learning, λ·quality + (1−λ)·diversity"
    ),
    "autodata": Selector(
        AutoDataConfig, select_autodata, "AutoData: apply a selection recipe (a file or a preset) to the feature bank"
    ),
    "oracle": Selector(
        OracleConfig, select_oracle, "offline labelled oracle: the target's domains first (reads labels: a ceiling)"
    ),
}


def run_selection(
    method: str,
    pool: str | Path,
    target: str | Path,
    budget: Budget,
    seed: int,
    out: str | Path,
    config: Any = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Select, write ``out`` and ``<out>.summary.json``, print the summary and return it."""
    if method not in SELECTORS:
        raise SelectionError(f"unknown selection method {method!r}; available: {', '.join(SELECTORS)}")
    spec = SELECTORS[method]
    config = spec.config() if config is None else config
    start = time.perf_counter()
    pool_c, target_c = load_corpus(pool, "pool"), load_corpus(target, "target")
    budget.check(pool_c)
    selection = spec.select(pool_c, target_c, budget, seed, config, progress)
    run = SelectionRun(method, str(pool), str(target), budget, seed, config)
    return write_selection(run, pool_c, selection, Path(out), time.perf_counter() - start)


def build_parser(parent: ActionSubCommands | None = None, name: str = "select") -> ArgumentParser:
    """The ``select`` command: one subcommand per selector, standalone or as subcommand ``name`` of ``parent``."""
    description = __doc__.split("\n\n")[0]
    p = command_parser("python -m selection_callbacks.offline.select", description, parent, name)
    sub = p.add_subcommands(dest="method", required=True)
    for method, spec in SELECTORS.items():
        a = ArgumentParser(description=spec.help)
        add_pool_arguments(a, "documents selectors may read (never the val split)",
                           "select ≥ this many tokens (fewest documents)", "select exactly this many documents")
        a.add_argument("--seed", type=int, default=0, help="selection seed")
        a.add_argument("--out", required=True, help="subset parquet to write")
        a.add_argument("--progress", type=bool, default=True, help="progress bars")
        a.add_class_arguments(spec.config, None)
        if method in SHARDED_METHODS:
            add_engine_arguments(a)
        sub.add_subcommand(method, a, help=spec.help)
    return p


def add_engine_arguments(parser: ArgumentParser) -> None:
    """``--engine local|ray`` and the sharded path's ``--workers``, ``--shards``, ``--work-dir``, ``--address``."""
    d = EngineConfig()
    parser.add_argument("--engine", choices=ENGINES, default=d.engine,
                        help="local: one process (default); ray: Ray Data map tasks over parquet shards, resumable")
    parser.add_argument("--workers", type=int, default=d.workers, help="ray: map tasks at a time (local cluster CPUs)")
    parser.add_argument("--shards", type=int, default=d.shards, help="ray: parquet shards of the pool")
    parser.add_argument("--work-dir", default=d.work_dir, help="ray: shards and stage tables (default <out>.work)")
    parser.add_argument("--address", default=d.address, help="ray: a running cluster's address (default: start one)")


def run(ns: Namespace) -> dict[str, Any]:
    """Run the selection an instantiated ``build_parser()`` namespace names; returns the summary."""
    a = ns[ns.method]
    config = SELECTORS[ns.method].config(**{f.name: a[f.name] for f in fields(SELECTORS[ns.method].config)})
    budget = Budget(tokens=a.budget_tokens, docs=a.budget_docs)
    if a.get("engine", "local") == "ray":
        engine = EngineConfig("ray", a.workers, a.shards, a.work_dir, a.address)
        return run_sharded_selection(ns.method, a.pool, a.target, budget, a.seed, a.out, config, engine, a.progress)
    return run_selection(ns.method, a.pool, a.target, budget, a.seed, a.out, config, a.progress)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """``python -m selection_callbacks.offline.select``: parse ``argv``, select, return the summary."""
    parser = build_parser()
    return run(parser.instantiate(parser.parse_args(argv)))


if __name__ == "__main__":
    main()
