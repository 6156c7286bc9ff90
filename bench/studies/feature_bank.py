"""The feature bank's proxy budget: how its columns and warmup delta's subset move with the tokens it trains on.

    python -m bench.studies.feature_bank --pool data/default/pool.jsonl --target data/default/target.jsonl \
        --budgets 500000,1000000,2000000,4000000 --out bench/results/feature-bank/budgets.json

For each budget (and a full pass, the reference) the bank is computed uncached with the library
defaults otherwise; printed per budget: seconds and peak memory of the bank, Spearman rank
correlation with the full-pass bank of the proxy columns (``delta``, ``loss_final``,
``grad_align``), and the share of the full-pass warmup-delta subset (``--subset-tokens``) that the
budget's warmup-delta subset keeps. A full pass with another proxy seed (``--noise-seed``) is the
noise floor: what a budget cannot be asked to beat. Runs one bank at a time in this process.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
from jsonargparse import ArgumentParser

from bench.harness.report import write_json
from selection_callbacks.offline.common.corpus import Budget, load_corpus
from selection_callbacks.offline.common.features import FeatureConfig, compute_features
from selection_callbacks.offline.warmup_delta.selector import WarmupDeltaConfig, delta_order

COLUMNS = ("delta", "loss_final", "grad_align")


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    """Rank correlation over the entries finite in both (ties broken by position)."""
    ok = np.isfinite(a) & np.isfinite(b)
    ra, rb = (np.argsort(np.argsort(x[ok], kind="stable")) for x in (a, b))
    return float(np.corrcoef(ra, rb)[0, 1])


def main(argv: list[str] | None = None) -> dict:
    p = ArgumentParser(prog="python -m bench.studies.feature_bank", description=__doc__.split("\n\n")[0])
    p.add_argument("--pool", required=True)
    p.add_argument("--target", required=True)
    p.add_argument("--budgets", default="500000,1000000,2000000,4000000", help="comma-separated proxy_tokens")
    p.add_argument("--subset-tokens", type=int, default=2_048_001, help="warmup-delta subset size compared")
    p.add_argument("--noise-seed", type=int, default=1, help="proxy seed of the second full-pass bank")
    p.add_argument("--out", required=True, help="JSON of the rows")
    a = p.parse_args(argv)
    pool, target = load_corpus(a.pool), load_corpus(a.target, "target")
    wd, take = WarmupDeltaConfig(), Budget(tokens=a.subset_tokens)
    rows, ref, ref_subset = [], None, None
    runs = [(None, 0), (None, a.noise_seed), *((int(b), 0) for b in a.budgets.split(","))]
    for budget, seed in runs:
        cfg = dataclasses.replace(FeatureConfig(), proxy_tokens=budget, seed=seed)
        bank = compute_features(pool, target, cfg, progress=False)
        subset = set(take.take(delta_order(bank.columns["delta"], wd.trim_low, wd.trim_high), pool.n_tokens).tolist())
        if ref is None:
            ref, ref_subset = bank, subset
        row = {
            "proxy_tokens": budget, "seed": seed, "share": bank.meta["proxy_sample"]["share"], "seconds": bank.meta["seconds"],
            "peak_rss_mb": max(c["peak_rss_mb"] for c in bank.meta["costs"].values()),
            **{f"spearman_{c}": spearman(bank.columns[c], ref.columns[c]) for c in COLUMNS},
            "warmup_delta_subset_kept": len(subset & ref_subset) / len(ref_subset),
        }
        rows.append(row)
        print(row, flush=True)
    header = "| proxy tokens | share of a pass | bank s | peak MB | " + " | ".join(f"ρ {c}" for c in COLUMNS) + \
        " | warmup-delta subset kept |"
    lines = [header, "|---" * (5 + len(COLUMNS)) + "|"]
    for r in rows:
        name = "full pass" if r["proxy_tokens"] is None else f"{r['proxy_tokens']:,}"
        name += f" (seed {r['seed']})" if r["seed"] else ""
        lines.append(f"| {name} | {r['share']:.1%} | {r['seconds']:.1f} | {r['peak_rss_mb']:.0f} | "
                     + " | ".join(f"{r[f'spearman_{c}']:.3f}" for c in COLUMNS)
                     + f" | {r['warmup_delta_subset_kept']:.1%} |")
    print("\n".join(lines))
    out = {"pool": a.pool, "target": a.target, "rows": rows, "table": "\n".join(lines)}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    write_json(Path(a.out), out)
    return out


if __name__ == "__main__":
    main()
