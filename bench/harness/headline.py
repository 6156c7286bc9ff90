"""Regenerate the README's headline figures from a committed results.json.

    python -m bench.harness.headline bench/results/cpu-tiny/results.json --block cpu-tiny --readme README.md

Rewrites the block between ``<!-- headline:NAME:start -->`` and ``<!-- headline:NAME:end -->``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from jsonargparse import ArgumentParser

from bench.harness.report import fmt_relative, fmt_value, load_summary, summarize, tuning_line

ROOT_README = Path(__file__).resolve().parents[2] / "README.md"


def markers(block: str) -> tuple[str, str]:
    return f"<!-- headline:{block}:start -->", f"<!-- headline:{block}:end -->"


def headline(results_path: Path) -> str:
    results = json.loads(results_path.read_text())
    resolved = results_path.resolve()
    shown = resolved.relative_to(ROOT_README.parent) if resolved.is_relative_to(ROOT_README.parent) else resolved
    summary = summarize(results)
    cfg = results["config"]
    lines = [
        f"From `{shown.as_posix()}` (commit `{results['commit']}`, config `{results['config_hash']}`): "
        f"{cfg['tokens']:,} update tokens per run, ratio {cfg['ratio']}, {cfg['optimizer']}, "
        f"{summary['random']['seeds']} paired seeds. {tuning_line(cfg)} {load_summary(results)}",
        "",
        "| method | final val bpb | Δ vs random (paired) | p | update tokens to random's final bpb | "
        "wall-clock to random's final bpb | step time vs random | share of its oracle's gain |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, s in summary.items():
        p = "—" if s["p_value"] != s["p_value"] else f"{s['p_value']:.3f}"
        lines.append(
            f"| {name} | {s['bpb_mean']:.4f} | {s['diff_mean']:+.4f} | {p} | {fmt_relative(s['tokens_to_random'])} | "
            f"{fmt_relative(s['wall_to_random'])} | {s['step_time_ratio']:.2f}× | "
            f"{fmt_value(s.get('oracle_share', float('nan')), '.0%')} |"
        )
    return "\n".join(lines)


def rewrite(readme: Path, name: str, block: str) -> str:
    start, end = markers(name)
    text = readme.read_text()
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.S)
    if not pattern.search(text):
        raise SystemExit(f"{readme} has no {start} … {end} block")
    return pattern.sub(lambda _: f"{start}\n{block}\n{end}", text)


def build_parser() -> ArgumentParser:
    """The ``bench.harness.headline`` arguments."""
    p = ArgumentParser(prog="python -m bench.harness.headline", description=__doc__.split("\n\n")[0])
    p.add_argument("results", type=Path, help="the bench.harness.compare results.json the figures come from")
    p.add_argument("--block", required=True, help="the README block to rewrite")
    p.add_argument("--readme", type=Path, default=Path("README.md"), help="the README rewritten in place")
    return p


def main(argv: list[str] | None = None) -> None:
    a = build_parser().parse_args(argv)
    a.readme.write_text(rewrite(a.readme, a.block, headline(a.results)))


if __name__ == "__main__":
    main()
