"""Regenerate the README's headline figures from a committed results.json.

    python -m bench.headline bench/results/cpu-tiny/results.json --readme README.md

Rewrites the block between ``<!-- headline:start -->`` and ``<!-- headline:end -->``.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from bench.report import summarize

START, END = "<!-- headline:start -->", "<!-- headline:end -->"


def headline(results_path: Path) -> str:
    results = json.loads(results_path.read_text())
    summary = summarize(results)
    cfg = results["config"]
    lines = [
        f"From `{results_path.as_posix()}` (commit `{results['commit']}`, config `{results['config_hash']}`): "
        f"{cfg['tokens']:,} update tokens per run, ratio {cfg['ratio']}, {cfg['optimizer']}, "
        f"{summary['random']['seeds']} paired seeds.",
        "",
        "| method | final val bpb | Δ vs random (paired) | p | update tokens to random's final bpb | step time vs random |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, s in summary.items():
        reached = [v for v in s["tokens_to_random"] if v is not None]
        tokens = f"{sum(reached) / len(reached):.2f}×" if len(reached) == len(s["tokens_to_random"]) else "not reached"
        p = "—" if s["p_value"] != s["p_value"] else f"{s['p_value']:.3f}"
        lines.append(
            f"| {name} | {s['bpb_mean']:.4f} | {s['diff_mean']:+.4f} | {p} | {tokens} | {s['step_time_ratio']:.2f}× |"
        )
    return "\n".join(lines)


def rewrite(readme: Path, block: str) -> str:
    text = readme.read_text()
    pattern = re.compile(re.escape(START) + r".*?" + re.escape(END), re.S)
    if not pattern.search(text):
        raise SystemExit(f"{readme} has no {START} … {END} block")
    return pattern.sub(lambda _: f"{START}\n{block}\n{END}", text)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.headline", description=__doc__.split("\n\n")[0])
    p.add_argument("results", type=Path)
    p.add_argument("--readme", type=Path, default=Path("README.md"))
    a = p.parse_args(argv)
    a.readme.write_text(rewrite(a.readme, headline(a.results)))


if __name__ == "__main__":
    main()
