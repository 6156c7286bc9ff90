"""A selection's record: the subset file, ``<out>.summary.json`` and the printed summary.

Shared by the single-process selectors (``offline.select``) and the sharded path
(``offline.sharded.select``); the pool is anything with ``ids``, ``domains`` and ``n_tokens`` [D],
so the sharded path writes it from its tables without the pool's text.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from selection_callbacks.data.subset import write_subset
from selection_callbacks.offline.common.corpus import Budget, Selection

__all__ = ["QUANTILES", "PoolIndex", "SelectionRun", "composition", "print_summary", "write_selection"]

QUANTILES = (0.0, 0.1, 0.5, 0.9, 1.0)


class PoolIndex(Protocol):
    """What a summary reads of a pool: str ids [D], str domains [D], int64 n_tokens [D]."""

    ids: np.ndarray
    domains: np.ndarray
    n_tokens: np.ndarray


@dataclass(frozen=True)
class SelectionRun:
    """What was asked: the method, its inputs, budget, seed and config (a dataclass)."""

    method: str
    pool: str
    target: str
    budget: Budget
    seed: int
    config: Any


def write_selection(run: SelectionRun, pool: PoolIndex, selection: Selection, out: Path, seconds: float) -> dict[str, Any]:
    """Check the subset is exactly the budget, write ``out`` and ``<out>.summary.json``, print and return the summary."""
    idx = np.asarray(selection.indices, dtype=np.int64)
    if np.unique(idx).size != idx.size or not np.array_equal(run.budget.take(idx, pool.n_tokens), idx):
        raise RuntimeError(f"selector {run.method!r} returned repeated documents or not exactly the budget")
    write_subset(out, "doc_id", pool.ids[idx].tolist())
    lengths = np.quantile(pool.n_tokens[idx], QUANTILES).tolist()
    summary = {
        "method": run.method,
        "seed": run.seed,
        "pool": run.pool,
        "target": run.target,
        "subset": str(out),
        "budget": {"tokens": run.budget.tokens, "docs": run.budget.docs},
        "documents": int(idx.size),
        "tokens": int(pool.n_tokens[idx].sum()),
        "seconds": round(seconds, 2),
        "domains": composition(pool, idx),
        "length_tokens_quantiles": dict(zip(map(str, QUANTILES), lengths)),
        "config": asdict(run.config),
        "info": selection.info,
    }
    Path(f"{out}.summary.json").write_text(json.dumps(summary, indent=1))
    print_summary(summary)
    return summary


def composition(pool: PoolIndex, idx: np.ndarray) -> dict[str, dict[str, float]]:
    """Per domain: chosen documents, share of the chosen tokens, and the domain's share of the pool's tokens."""
    chosen_tokens = pool.n_tokens[idx].sum()
    out = {}
    for d in np.unique(pool.domains):
        mine = pool.domains[idx] == d
        out[str(d)] = {
            "docs": int(mine.sum()),
            "token_share": float(pool.n_tokens[idx][mine].sum() / chosen_tokens),
            "pool_token_share": float(pool.n_tokens[pool.domains == d].sum() / pool.n_tokens.sum()),
        }
    return out


def print_summary(s: dict[str, Any]) -> None:
    b = s["budget"]
    budget = f"{b['docs']} documents" if b["docs"] is not None else f"{b['tokens']:,} tokens"
    print(f"[select] {s['method']} (seed {s['seed']}): {s['documents']} documents, {s['tokens']:,} tokens "
          f"(budget {budget}) in {s['seconds']:.1f} s -> {s['subset']}")
    print(f"  {'domain':<14s} {'docs':>6s} {'tokens':>8s} {'pool':>8s}")
    for d, c in sorted(s["domains"].items(), key=lambda kv: -kv[1]["token_share"]):
        print(f"  {d:<14s} {c['docs']:>6d} {c['token_share']:>8.1%} {c['pool_token_share']:>8.1%}")
    q = s["length_tokens_quantiles"]
    print("  length (tokens): " + ", ".join(f"q{float(k):g}={v:.0f}" for k, v in q.items()))
