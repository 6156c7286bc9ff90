"""Seconds per code-recipe call: the kernel sandbox against a forked child running ``exec`` (the
unconfined runner the sandbox replaced), on a feature table of the default corpus's shape.

The table has the pool's documents and token counts and every feature column (float64) and cell
column (int64) a real bank has; the values are random, which does not change what a call costs
(spawn, imports, sending the table, confinement, the recipe, the answer). The term recipe applied
in-process is shown for scale.

    PYTHONPATH=$PWD python -m bench.studies.sandbox_overhead --pool data/default/pool.jsonl --calls 10
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import time

import numpy as np

from selection_callbacks.offline.autodata.evaluation import FeatureTable, run_recipe
from selection_callbacks.offline.autodata.schema import CATEGORICAL, FEATURES, load_recipe
from selection_callbacks.offline.common.corpus import Budget, load_corpus

CODE = ("import numpy as np\ndef select(table, n_tokens, budget, rng):\n"
        "    return budget.take(np.argsort(-table['dsir'], kind='stable'), n_tokens)\n")


def shaped_table(pool_path: str) -> FeatureTable:
    """Random columns with the pool's documents and token counts."""
    n_tokens = load_corpus(pool_path).n_tokens.astype(np.int64)
    rng = np.random.default_rng(0)
    numeric = {f: rng.lognormal(0.0, 1.0, n_tokens.size) for f in FEATURES}
    categorical = {c: rng.integers(0, 8, n_tokens.size) for c in CATEGORICAL}
    return FeatureTable(numeric, categorical, n_tokens)


def _forked(conn, table: FeatureTable, budget: Budget, seed: int) -> None:
    scope: dict = {}
    exec(compile(CODE, "<recipe code>", "exec"), scope)
    conn.send(np.asarray(scope["select"](table.columns(), table.n_tokens.copy(), budget,
                                         np.random.default_rng([seed, 0xA07D]))))
    conn.close()


def forked_child(table: FeatureTable, budget: Budget, seed: int) -> np.ndarray:
    """The replaced runner: ``exec`` in a forked child, the answer over a pipe."""
    ctx = mp.get_context("fork")
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_forked, args=(send, table, budget, seed), daemon=True)
    proc.start()
    send.close()
    out = recv.recv()
    proc.join()
    return out


def seconds_per_call(fn, calls: int) -> tuple[float, float]:
    """Median and minimum seconds of ``calls`` calls of ``fn`` (after one warm-up call)."""
    fn()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times)), float(np.min(times))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pool", default="data/default/pool.jsonl")
    parser.add_argument("--calls", type=int, default=10)
    args = parser.parse_args()
    table = shaped_table(args.pool)
    budget = Budget(tokens=int(table.n_tokens.sum()) // 4)
    code = {"name": "bench", "code": CODE}
    sandboxed = run_recipe(code, table, budget, 0)
    np.testing.assert_array_equal(sandboxed, forked_child(table, budget, 0))
    print(f"table: {len(table)} documents, {len(table.columns())} columns")
    for name, fn in [("sandbox (spawned, confined)", lambda: run_recipe(code, table, budget, 0)),
                     ("forked child (exec, unconfined)", lambda: forked_child(table, budget, 0)),
                     ("term recipe in-process", lambda: run_recipe(load_recipe("autodata_best"), table, budget, 0))]:
        median, best = seconds_per_call(fn, args.calls)
        print(f"{name:34s} median {median:.3f} s   min {best:.3f} s per call")


if __name__ == "__main__":
    main()
