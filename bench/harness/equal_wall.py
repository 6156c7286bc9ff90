"""Methods against random at equal wall-clock, with step times from a quiet interleaved run.

    python -m bench.harness.equal_wall bench/results/cpu-tiny-b64-muon/results.json \
        bench/results/steptime/cpu-tiny-b64-muon/steptime.json --out bench/results/cpu-tiny-b64-muon/equal_wall.md

Several step-time files of one scale (a method timed later against its own random) are read as one
(:func:`read_steptimes`).

A comparison's own wall-clock is only as fair as the machine was quiet while each run trained
(runs made at different times, or side by side, see different load). ``bench.harness.steptime`` measures
each method's step time against random's in one interleaved run instead. With that ratio r (the
median over repeats of the in-run ratio, which splits each run's own steps into selection and the
rest so that the host's drift between runs cancels; the run-against-run ratio for timings without
it), a method's wall-clock after s steps is r·s random steps, so in random's wall-clock W it trains
on tokens(W)/r update tokens. Per paired seed this reports:

- its val bpb at random's full wall-clock: its curve over update tokens, interpolated at random's
  total tokens / r (paired t-test against random's final bpb; negative is better);
- wall-clock to random's final bpb: r × (update tokens to random's final bpb) / random's tokens.

The crossing is reported twice: with one-off costs amortised (left out, as if shared by many runs)
and charged to the run, as a fraction f of random's run added to it. f is the sum of
- the in-run start-up, e.g. a reference pretrained when training starts: the method's fitted
  intercept in ``bench.harness.steptime`` minus random's, in random steps, over random's steps;
- a prepare stage run before training (``one_off_seconds`` in the comparison, e.g. ``rho_lookup``'s
  reference and loss table): its seconds over random's wall-clock for the same seed in the
  comparison. Both were measured under the comparison's load, not the quiet step-time run's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
from jsonargparse import ArgumentParser

from bench.harness.report import crossing, fmt_relative, fmt_value, paired_test


def value_at(curve: list[list[float]], tokens: float) -> float:
    """Val bpb at ``tokens`` update tokens, linearly interpolated between evaluations (curve rows: tokens, wall, bpb)."""
    xs, ys = [p[0] for p in curve], [p[2] for p in curve]
    if not xs[0] <= tokens <= xs[-1]:
        raise ValueError(f"{tokens:.0f} update tokens lie outside the curve's {xs[0]:.0f}..{xs[-1]:.0f}")
    return float(np.interp(tokens, xs, ys))


def read_steptimes(paths: list[Path]) -> dict[str, Any]:
    """Several ``bench.harness.steptime`` runs of one scale, optimizer, ratio and step as one steptime.json.

    Each method keeps the run that timed it against random: its in-run ratio is its own, and an entry from a later
    file carries that file's random as ``timed_random`` (its step time and start-up, which :func:`one_off_fraction`
    charges against). The first file's random and config stand for the rest.

    Raises:
        SystemExit: the files differ in scale, optimizer, ratio or update tokens per step, or two time one method
            other than random.

    Example::

        read_steptimes([Path("steptime/steptime.json"), Path("steptime-classact-windows/steptime.json")])
    """
    first, *rest = [json.loads(p.read_text()) for p in paths]
    merged = {**first, "methods": dict(first["methods"]), "files": [str(p) for p in paths]}
    for path, timed in zip(paths[1:], rest):
        for key in ("scale", "optimizer", "ratio", "tokens_per_step"):
            if timed["config"].get(key) != first["config"].get(key):
                raise SystemExit(f"{path} timed {key} {timed['config'].get(key)}, {paths[0]} "
                                 f"{first['config'].get(key)}: give step-time files of one shape")
        random = {k: v for k, v in timed["methods"]["random"].items() if k != "runs"}
        for name, entry in timed["methods"].items():
            if name == "random":
                continue
            if name in merged["methods"]:
                raise SystemExit(f"{name} is timed in {path} and an earlier file: give each method one step-time run")
            merged["methods"][name] = {**entry, "timed_random": random}
    return merged


def equal_wall(results: dict[str, Any], steptime: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per method timed in ``steptime``: bpb at random's wall-clock (paired) and wall-clock to random's final bpb."""
    if "random" not in results["methods"] or "random" not in steptime["methods"]:
        raise ValueError("both files need a random baseline")
    random_runs = {r["seed"]: r for r in results["methods"]["random"]["runs"]}
    out: dict[str, dict[str, Any]] = {}
    for name, entry in results["methods"].items():
        if name not in steptime["methods"]:
            continue
        ratio = step_time_ratio(steptime["methods"][name])
        runs = [r for r in entry["runs"] if r["seed"] in random_runs]
        at_wall, diffs, wall_to, charged = [], [], [], []
        for r in runs:
            base = random_runs[r["seed"]]
            budget = base["curve"][-1][0] / ratio  # update tokens it trains on in random's wall-clock
            bpb = value_at(r["curve"], min(budget, r["curve"][-1][0]))  # a faster method: its final bpb (conservative)
            at_wall.append(bpb)
            diffs.append(bpb - base["final_val_bpb"])
            t = crossing(r["curve"], base["final_val_bpb"], 0)
            wall_to.append(None if t is None else ratio * t / base["curve"][-1][0])
            charged.append(None if t is None else wall_to[-1] + one_off_fraction(r, base, name, steptime))
        mean, std, p = paired_test(diffs)
        out[name] = {"step_time_ratio": ratio, "seeds": len(runs), "bpb_at_random_wall": at_wall,
                     "diff_mean": mean, "diff_std": std, "p_value": p, "better_seeds": sum(d < 0 for d in diffs),
                     "wall_to_random": wall_to, "wall_to_random_charged": charged}
    return out


def step_time_ratio(timed: dict[str, Any]) -> float:
    """The method's step time over random's: the in-run ratio where the timing has one (each run's own steps split
    into selection and the rest, so the host's drift between runs cancels), else the run-against-run median."""
    in_run = timed.get("in_run_ratio_median")
    return float(timed["ratio_to_random_median"] if in_run is None else in_run)


def one_off_fraction(run: dict[str, Any], base: dict[str, Any], name: str, steptime: dict[str, Any]) -> float:
    """f = in-run start-up / random's run in the quiet timing + prepare seconds / random's wall-clock in the comparison."""
    timed = steptime["methods"][name]
    random = timed.get("timed_random", steptime["methods"]["random"])
    startup = max(timed.get("fixed_seconds_median", 0.0) - random.get("fixed_seconds_median", 0.0), 0.0)
    random_seconds = random["step_ms_median"] / 1000 * base["curve"][-1][0] / steptime["config"]["tokens_per_step"]
    return startup / random_seconds + run.get("one_off_seconds", 0.0) / base["wall_seconds"]


def markdown(summary: dict[str, dict[str, Any]], results_path: Path, steptime_paths: list[Path]) -> str:
    lines = [
        "# Equal wall-clock against random",
        "",
        f"Curves from `{results_path}`, step-time ratios from {', '.join(f'`{p}`' for p in steptime_paths)} "
        "(in-run where they have them; "
        "`python -m bench.harness.equal_wall`). "
        "Δ: val bpb at random's full wall-clock minus random's final bpb, paired by seed (negative is better).",
        "",
        "| method | step time × | seeds | val bpb at random's wall-clock | Δ vs random | p | better in | wall-clock to random's final bpb, one-offs amortised | one-offs charged |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, s in summary.items():
        lines.append(
            f"| {name} | {s['step_time_ratio']:.2f} | {s['seeds']} | {np.mean(s['bpb_at_random_wall']):.4f} | "
            f"{s['diff_mean']:+.4f} ± {fmt_value(s['diff_std'], '.4f')} | {fmt_value(s['p_value'], '.3f')} | "
            f"{s['better_seeds']}/{s['seeds']} | {fmt_relative(s['wall_to_random'])} | {fmt_relative(s['wall_to_random_charged'])} |"
        )
    return "\n".join(lines) + "\n"


def build_parser() -> ArgumentParser:
    """The ``bench.harness.equal_wall`` arguments."""
    p = ArgumentParser(prog="python -m bench.harness.equal_wall", description=__doc__.split("\n\n")[0])
    p.add_argument("results", type=Path, help="a bench.harness.compare results.json")
    p.add_argument("steptime", type=Path, nargs="+",
                   help="bench.harness.steptime steptime.json files of the same scale and optimizer")
    p.add_argument("--out", type=Path, help="write the table here (default: print it)")
    return p


def main(argv: list[str] | None = None) -> dict[str, dict[str, Any]]:
    a = build_parser().parse_args(argv)
    results, steptime = json.loads(a.results.read_text()), read_steptimes(a.steptime)
    for key in ("optimizer", "ratio"):
        if key in steptime.get("config", {}) and steptime["config"][key] != results["config"][key]:
            raise SystemExit(f"{key} differs: {results['config'][key]} in {a.results}, {steptime['config'][key]} in "
                             f"{a.steptime[0]}")
    summary = equal_wall(results, steptime)
    text = markdown(summary, a.results, a.steptime)
    if a.out:
        a.out.write_text(text)
    print(text, end="")
    return summary


if __name__ == "__main__":
    main()
