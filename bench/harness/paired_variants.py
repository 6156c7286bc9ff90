"""Methods against one of their variants, paired by seed, from a ``bench.harness.compare`` results.json.

    python -m bench.harness.paired_variants bench/results/feature-bank/results.json --variant @bank.proxy_tokens=null \
        --base @bank.proxy_tokens=4000000

For every method ``m`` with both ``m<base>`` (``--base``, default: ``m`` itself) and ``m<variant>`` in
the results: the final val bpb of each seed under both, the paired difference
Δ = m<base> − m<variant> (mean ± std, two-sided paired t-test) and the seed noise of the variant
(the std of its final bpb over seeds). *Within seed noise* means |mean Δ| is below that std and
p ≥ 0.05.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from jsonargparse import ArgumentParser

from bench.harness.report import fmt_value, paired_test


def paired_rows(results: dict, variant: str, base: str = "") -> list[dict]:
    """One row per method that has ``base`` and ``variant``: per-seed values, Δ statistics and the verdict."""
    methods = results["methods"]
    rows = []
    for name in dict.fromkeys(n.split("@")[0] for n in methods):
        entry, other = methods.get(name + base), methods.get(name + variant)
        if entry is None or other is None or base == variant:
            continue
        mine = {r["seed"]: r["final_val_bpb"] for r in entry["runs"]}
        theirs = {r["seed"]: r["final_val_bpb"] for r in other["runs"]}
        seeds = sorted(set(mine) & set(theirs))
        diffs = [mine[s] - theirs[s] for s in seeds]
        mean, std, p = paired_test(diffs)
        noise = float(np.std([theirs[s] for s in seeds], ddof=1)) if len(seeds) > 1 else float("nan")
        rows.append({"method": name, "seeds": seeds, "bpb": [mine[s] for s in seeds],
                     "bpb_variant": [theirs[s] for s in seeds], "diff_mean": mean, "diff_std": std, "p_value": p,
                     "variant_seed_std": noise, "within_noise": bool(abs(mean) < noise and not p < 0.05)})
    return rows


def markdown(rows: list[dict], variant: str, base: str = "") -> str:
    lines = [f"| method | seeds | val bpb `{base or 'm'}` (per seed) | val bpb `{variant}` (per seed) | Δ (mean ± std) | p | "
             f"seed std of `{variant}` | within seed noise |", "|---|---:|---|---|---:|---:|---:|---|"]
    for r in rows:
        per = lambda v: ", ".join(f"{x:.4f}" for x in v)  # noqa: E731
        lines.append(f"| {r['method']} | {len(r['seeds'])} | {per(r['bpb'])} | {per(r['bpb_variant'])} | "
                     f"{r['diff_mean']:+.4f} ± {fmt_value(r['diff_std'], '.4f')} | {fmt_value(r['p_value'], '.3f')} | "
                     f"{fmt_value(r['variant_seed_std'], '.4f')} | {'yes' if r['within_noise'] else 'no'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    p = ArgumentParser(prog="python -m bench.harness.paired_variants", description=__doc__.split("\n\n")[0])
    p.add_argument("results", type=Path, help="a bench.harness.compare results.json")
    p.add_argument("--variant", required=True, help="the variant suffix, e.g. @bank.proxy_tokens=null")
    p.add_argument("--base", default="", help="the compared arm's suffix (default: the plain method)")
    a = p.parse_args(argv)
    rows = paired_rows(json.loads(Path(a.results).read_text()), a.variant, a.base)
    if not rows:
        raise SystemExit(f"no method of {a.results} has a {a.variant!r} variant")
    print(markdown(rows, a.variant, a.base))
    return rows


if __name__ == "__main__":
    main()
