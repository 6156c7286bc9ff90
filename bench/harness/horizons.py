"""Methods against tuned random as runs grow longer: the horizon report.

    R=bench/results
    python -m bench.harness.horizons --methods random,oracle,rho@score_len=16,rho@score_len=16@reference_steps=1200,opus,classact \
        --cell cpu-mini=$R/horizons/cpu-mini-2M/results.json:$R/ladder/steptime-cpu-mini/steptime.json \
        --cell cpu-mini=$R/horizons/cpu-mini-8M/results.json:$R/ladder/steptime-cpu-mini/steptime.json \
        ... --curves cpu-tiny-20M --out $R/horizons

A cell is ``SCALE=RESULTS:STEPTIME`` (:func:`bench.harness.ladder.parse_rung`): a ``bench.harness.compare``
results.json of one scale at one run length, against random tuned at that length, and the scale's in-run step-time
file (step ratios depend on the shapes, N and K, not on the pool or the run's length). Per cell and method:

- Δ: final val bpb minus random's, paired by seed, with its 95% t-interval, p and per-seed values, the online
  oracle's Δ beside it (:func:`bench.harness.ladder.paired_cell`);
- tokens ×: update tokens to random's final bpb over random's (per seed; "not reached" where the curve never
  gets there);
- wall-clock to random's final bpb over random's, one-offs charged (:func:`bench.harness.equal_wall.equal_wall`).

A variant that only lengthens RHO-LOSS's or ClassAct's reference pretraining (``@reference_steps=R``) has no
step-time run of its own: its step ratio is its base's, and its in-run start-up over random's is the base's scaled
by R over the base's reference steps (the start-up is the reference's pretraining, linear in its steps).

Per method and scale the report states whether its gain at the scale's longest run *holds* (Δ inside the
shortest run's 95% interval), *shrinks* or *grows* (outside it, closer to or further from 0), or *vanishes* (its
own interval includes 0). Writes ``report.md``, ``horizons.json``, ``delta_vs_horizon.png``,
``tokens_vs_horizon.png`` and, for ``--curves CELL``, ``curves-CELL.png`` (every method's val bpb against update
tokens, mean over seeds, beside its paired difference from random's).
"""

from __future__ import annotations

import copy
import json
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np
from jsonargparse import ArgumentParser

from bench.harness.compare import horizon_label, split_variant
from bench.harness.ladder import NOT_MEASURED, load_rung, method_settings, rung_cells, values
from bench.harness.report import crossing, fmt_relative, fmt_value


def cell_name(cell: dict[str, Any]) -> str:
    """``"cpu-mini-32M"``: the scale and the run length."""
    return f"{cell['name']}-{horizon_label(cell['tokens'])}"


def base_variant(name: str) -> tuple[str, int] | None:
    """``"rho@score_len=16@reference_steps=1200"`` → ``("rho@score_len=16", 1200)``; None without the override."""
    base, overrides = split_variant(name)
    steps = [v for k, v in overrides if k == "reference_steps"]
    if not steps:
        return None
    rest = "".join(f"@{k}={v}" for k, v in overrides if k != "reference_steps")
    return base + rest, int(steps[0])


def with_derived_timings(steptime: dict[str, Any], methods: list[str]) -> dict[str, Any]:
    """The step-time file with an entry for each ``@reference_steps=R`` variant whose base it timed: the base's step
    ratio, its start-up over random's scaled by R / the base's reference steps."""
    out = copy.deepcopy(steptime)
    for name in methods:
        derived = base_variant(name)
        if name in out["methods"] or derived is None or derived[0] not in out["methods"]:
            continue
        base, steps = derived
        entry = copy.deepcopy(out["methods"][base])
        random_startup = entry.get("timed_random", out["methods"]["random"]).get("fixed_seconds_median", 0.0)
        scale = steps / method_settings(base)["reference_steps"]
        entry["fixed_seconds_median"] = random_startup + scale * (entry.get("fixed_seconds_median", 0.0) - random_startup)
        entry["derived_from"] = {"method": base, "startup_scale": scale}
        out["methods"][name] = entry
    return out


def token_multipliers(results: dict[str, Any], name: str) -> list[float | None]:
    """Per seed: update tokens to random's final val bpb over random's update tokens (None: never reached)."""
    random = {r["seed"]: r for r in results["methods"]["random"]["runs"]}
    runs = sorted((r for r in results["methods"].get(name, {}).get("runs", []) if r["seed"] in random),
                  key=lambda r: r["seed"])
    out = []
    for r in runs:
        base = random[r["seed"]]
        t = crossing(r["curve"], base["final_val_bpb"], 0)
        out.append(None if t is None else t / base["curve"][-1][0])
    return out


def load_cell(text: str, methods: list[str]) -> dict[str, Any]:
    """A cell's comparison and timings (derived variants added), with its parameters and tokens per parameter."""
    cell = load_rung(text)
    if cell["steptime"] is not None:
        cell["steptime"] = with_derived_timings(cell["steptime"], methods)
    cell["cell"] = cell_name(cell)
    return cell


def cell_rows(cell: dict[str, Any], methods: list[str]) -> dict[str, dict[str, Any] | None]:
    """Per method: the ladder's paired cell (Δ, interval, p, oracle Δ, step, wall) with the token multipliers."""
    rows = rung_cells(cell, methods)
    for name, row in rows.items():
        if row is not None:
            row["tokens"] = token_multipliers(cell["results"], name)
            row["derived_timing"] = ((cell["steptime"] or {}).get("methods", {}).get(name) or {}).get("derived_from")
    return rows


def verdict(short: dict[str, Any], long: dict[str, Any]) -> str:
    """How a gain at the longest run compares with the shortest: holds, shrinks, grows or vanishes."""
    lo, hi = long["ci"]
    if not (math.isnan(lo) or math.isnan(hi)) and lo <= 0 <= hi:
        return "vanishes"
    s_lo, s_hi = short["ci"]
    if s_lo <= long["diff_mean"] <= s_hi:
        return "holds"
    return "shrinks" if abs(long["diff_mean"]) < abs(short["diff_mean"]) else "grows"


def verdicts(cells: list[dict[str, Any]], rows: dict[str, dict[str, Any]], methods: list[str]) -> list[dict[str, Any]]:
    """Per scale with ≥ 2 run lengths and method run at its shortest and longest: the verdict with its numbers."""
    out = []
    for scale in dict.fromkeys(c["name"] for c in cells):
        mine = sorted((c for c in cells if c["name"] == scale), key=lambda c: c["tokens"])
        if len(mine) < 2:
            continue
        short, long = mine[0], mine[-1]
        for name in (m for m in methods if m != "random"):
            a, b = rows[short["cell"]].get(name), rows[long["cell"]].get(name)
            if a is None or b is None:
                continue
            out.append({"scale": scale, "method": name, "short": short["cell"], "long": long["cell"],
                        "short_tpp": short["tokens_per_param"], "long_tpp": long["tokens_per_param"],
                        "short_delta": a["diff_mean"], "short_ci": a["ci"], "long_delta": b["diff_mean"],
                        "long_ci": b["ci"], "short_tokens": reached_mean(a["tokens"]),
                        "long_tokens": reached_mean(b["tokens"]), "verdict": verdict(a, b)})
    return out


def reached_mean(xs: list[float | None] | None) -> float:
    """The mean over the seeds that reached random's final bpb (nan when none did)."""
    reached = [x for x in xs or [] if x is not None]
    return float(np.mean(reached)) if reached else float("nan")


def table_lines(cells: list[dict[str, Any]], rows: dict[str, dict[str, Any]], methods: list[str]) -> list[str]:
    """One row per method and cell."""
    lines = ["| method | cell | tokens per parameter | seeds | val bpb per seed | Δ per seed | Δ vs random [95% interval] "
             "| p | oracle Δ | tokens to random's bpb × | step × | wall-clock to random's bpb ×, one-offs charged |",
             "|---|---|---:|---|---|---|---|---:|---:|---:|---:|---:|"]
    for name in methods:
        for cell in cells:
            row = rows[cell["cell"]].get(name)
            head = f"| {name} | {cell['cell']} | {cell['tokens_per_param']:.1f} |"
            if row is None:
                lines.append(f"{head} not run |" + " |" * 8)
                continue
            lo, hi = row["ci"]
            step = NOT_MEASURED if row["step"] is None else f"{row['step']:.2f}" + (" (derived)" if row["derived_timing"] else "")
            wall = NOT_MEASURED if row["wall_charged"] is None else fmt_relative(row["wall_charged"])
            tokens = "–" if name == "random" else fmt_relative(row["tokens"])
            lines.append(f"{head} {values(row['seeds'], 'd')} | {values(row['bpb'])} | {values(row['diffs'], '+.4f')} | "
                         f"{row['diff_mean']:+.4f} [{fmt_value(lo, '+.4f')}, {fmt_value(hi, '+.4f')}] | "
                         f"{fmt_value(row['p_value'], '.3f')} | {fmt_value(row['oracle_diff'], '+.4f')} | {tokens} | "
                         f"{step} | {wall} |")
    return lines + ["", "Δ: final val bits per byte minus tuned random's on the same seed (negative is better), its "
                    "mean with the 95% t-interval over the paired differences and the two-sided paired t-test's p; "
                    "each cell's random is tuned at that cell's scale, pool and run length. Tokens ×: update tokens "
                    "to random's final bpb over random's, per seed as the report renders it (mean of the seeds that "
                    "reached it). Step ×: the in-run step ratio of the scale's step-time file; (derived): a "
                    "`reference_steps` variant, timed as its base. Wall-clock ×: step × times tokens ×, with the "
                    "one-off start-up (the reference's pretraining) and prepare costs charged as a fraction of "
                    "random's run."]


def verdict_lines(rows: list[dict[str, Any]]) -> list[str]:
    """The verdicts' table."""
    if not rows:
        return ["No scale has two run lengths yet."]
    lines = ["| scale | method | shortest run: Δ [95%], tokens × | longest run: Δ [95%], tokens × | verdict |",
             "|---|---|---|---|---|"]
    for r in rows:
        cells = []
        for key in ("short", "long"):
            lo, hi = r[f"{key}_ci"]
            cells.append(f"{r[key]} ({r[f'{key}_tpp']:.0f} tok/param): {r[f'{key}_delta']:+.3f} "
                         f"[{fmt_value(lo, '+.3f')}, {fmt_value(hi, '+.3f')}], {fmt_value(r[f'{key}_tokens'], '.2f')}×")
        lines.append(f"| {r['scale']} | {r['method']} | {cells[0]} | {cells[1]} | **{r['verdict']}** |")
    return lines + ["", "Holds: the longest run's Δ lies inside the shortest run's 95% interval; shrinks or grows: "
                    "outside it, nearer to or further from 0; vanishes: the longest run's own interval includes 0."]


PLOTS = {"delta": ("delta_vs_horizon.png", "Δ final val bpb vs tuned random (negative is better)", 0.0),
         "tokens": ("tokens_vs_horizon.png", "update tokens to random's final bpb × random's", 1.0)}


def plot(cells: list[dict[str, Any]], rows: dict[str, dict[str, Any]], methods: list[str], out: Path) -> list[Path]:
    """Δ and tokens × against tokens per parameter (one log axis for every panel): a panel per method, a line per
    scale, each seed a point, the mean (Δ: with its 95% interval) a marker."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    names = [m for m in methods if m != "random"]
    scales = list(dict.fromkeys(c["name"] for c in cells))
    written = []
    for kind, (file, ylabel, level) in PLOTS.items():
        fig, axes = plt.subplots(1, len(names), figsize=(3.3 * len(names), 3.6), sharex=True, sharey=True,
                                 squeeze=False)
        for ax, name in zip(axes[0], names):
            ax.axhline(level, color="black", lw=0.8)
            for i, scale in enumerate(scales):
                color, xs, centres = plt.get_cmap("tab10")(i), [], []
                for cell in sorted((c for c in cells if c["name"] == scale), key=lambda c: c["tokens"]):
                    row = rows[cell["cell"]].get(name)
                    if row is None:
                        continue
                    x = cell["tokens_per_param"]
                    points = row["diffs"] if kind == "delta" else [t for t in row["tokens"] if t is not None]
                    ax.scatter([x] * len(points), points, color=color, s=12, alpha=0.45, lw=0)
                    centre = row["diff_mean"] if kind == "delta" else reached_mean(row["tokens"])
                    if kind == "delta" and not math.isnan(row["ci"][0]):
                        ax.errorbar([x], [centre], yerr=[[centre - row["ci"][0]], [row["ci"][1] - centre]],
                                    color=color, capsize=3)
                    xs.append(x)
                    centres.append(centre)
                ax.plot(xs, centres, "o-", color=color, label=scale)
            ax.set_xscale("log")
            ax.xaxis.set_major_formatter(ScalarFormatter())
            ax.xaxis.set_minor_formatter(NullFormatter())  # the log axis' minor labels overlap over one decade
            ax.set_title(name, fontsize=9)
            ax.set_xlabel("update tokens per parameter")
            ax.grid(alpha=0.3)
        axes[0][0].set_ylabel(ylabel, fontsize=8)
        axes[0][-1].legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / file, dpi=110, bbox_inches="tight")
        plt.close(fig)
        written.append(out / file)
    return written


def paired_gap(results: dict[str, Any], method: str) -> list[float] | None:
    """Mean over the seeds both ran of the method's val bpb minus random's at each evaluation; None without one.

    Δ_e = (1/|S|) Σ_{s∈S} (bpb_method,s,e − bpb_random,s,e), S the seeds of both.

    Args:
        results: a ``bench.harness.compare`` results.json, each run's ``curve`` rows [tokens, seconds, bpb].
        method: a method of ``results``.

    Example:
        >>> run = lambda s, bpbs: {"seed": s, "curve": [[t, 0.0, b] for t, b in zip((1, 2), bpbs)]}
        >>> results = {"methods": {"random": {"runs": [run(0, (3.0, 2.0))]},
        ...                        "rho": {"runs": [run(0, (2.5, 1.75)), run(1, (2.0, 1.0))]}}}
        >>> paired_gap(results, "rho")  # seed 1 has no random to pair with
        [-0.5, -0.25]
    """
    random = {r["seed"]: [p[2] for p in r["curve"]] for r in results["methods"]["random"]["runs"]}
    paired = [np.subtract([p[2] for p in r["curve"]], random[r["seed"]])
              for r in results["methods"][method]["runs"] if r["seed"] in random]
    return [float(d) for d in np.mean(paired, axis=0)] if paired else None


def plot_curves(cell: dict[str, Any], methods: list[str], out: Path) -> Path:
    """Every method's val bpb against update tokens in one cell, the mean over seeds at each evaluation (left), and
    its paired difference from random's, the mean over the seeds both ran (right: where a gain opens or closes)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, gap) = plt.subplots(1, 2, figsize=(12, 4.4))
    for i, name in enumerate(m for m in methods if m in cell["results"]["methods"]):
        runs = cell["results"]["methods"][name]["runs"]
        millions = [p[0] / 1e6 for p in runs[0]["curve"]]
        style = {"color": plt.get_cmap("tab10")(i % 10), "label": f"{name} ({len(runs)} seed{'s' * (len(runs) > 1)})"}
        ax.plot(millions, np.mean([[p[2] for p in r["curve"]] for r in runs], axis=0), "-", **style)
        gaps = paired_gap(cell["results"], name)
        if gaps is not None:
            gap.plot(millions, gaps, "-", **style)
    ax.set_ylabel("val bpb, mean over seeds")
    gap.set_ylabel("Δ val bpb vs random, paired by seed")
    gap.axhline(0.0, color="black", lw=0.8)
    for axis in (ax, gap):
        axis.set_xlabel("update tokens (millions)")
        axis.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.suptitle(f"{cell['cell']}: {cell['tokens_per_param']:.0f} update tokens per parameter", fontsize=9)
    fig.tight_layout()
    path = out / f"curves-{cell['cell']}.png"
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def markdown(report: dict[str, Any], cells: list[dict[str, Any]], methods: list[str], command: str,
             curves: list[Path]) -> str:
    """report.md: the cells, the table, the verdicts and the plots."""
    cell_lines = ["| cell | learner parameters | update tokens | tokens per parameter | comparison | step times |",
                  "|---|---:|---:|---:|---|---|"]
    for c in cells:
        cell_lines.append(f"| {c['cell']} | {c['params']:,} | {c['tokens']:,} | {c['tokens_per_param']:.1f} | "
                          f"`{c['results_path']}` | {'`' + c['steptime_path'] + '`' if c['steptime_path'] else NOT_MEASURED} |")
    lines = ["# Methods against tuned random as runs grow longer", "", f"`{command}`", "", "## Cells", "", *cell_lines,
             "", "## Methods against tuned random in each cell", "", *table_lines(cells, report["rows"], methods), "",
             "## Does the gain survive a longer run?", "", *verdict_lines(report["verdicts"]), "", "## Plots", "",
             *[f"![{ylabel}]({file})" for file, ylabel, _ in PLOTS.values()],
             *[f"![val bpb curves]({p.name})" for p in curves]]
    return "\n".join(lines) + "\n"


def build_parser() -> ArgumentParser:
    """The ``bench.harness.horizons`` flags."""
    p = ArgumentParser(prog="python -m bench.harness.horizons", description=__doc__.split("\n\n")[0])
    p.add_argument("--cell", action="append", required=True,
                   help="SCALE=RESULTS:STEPTIME: one run length's comparison and the scale's step-time file; repeat")
    p.add_argument("--methods", required=True, help="comma-separated, random first; name@arg=value variants")
    p.add_argument("--curves", action="append", default=[], help="a cell (e.g. cpu-tiny-20M) whose curves to plot")
    p.add_argument("--out", type=Path, required=True, help="folder of report.md, horizons.json and the plots")
    return p


def main(argv: list[str] | None = None) -> dict[str, Any]:
    a = build_parser().parse_args(argv)
    methods = [m.strip() for m in a.methods.split(",") if m.strip()]
    if "random" not in methods:
        raise SystemExit("the horizons are against random: include 'random' in --methods")
    cells = sorted((load_cell(text, methods) for text in a.cell), key=lambda c: (c["params"], c["tokens"]))
    unknown = set(a.curves) - {c["cell"] for c in cells}
    if unknown:
        raise SystemExit(f"--curves {sorted(unknown)}: no such cell; cells: {[c['cell'] for c in cells]}")
    rows = {c["cell"]: cell_rows(c, methods) for c in cells}
    report = {"cells": [{k: c[k] for k in ("cell", "name", "results_path", "steptime_path", "params", "tokens",
                                           "tokens_per_param")} for c in cells],
              "rows": rows, "verdicts": verdicts(cells, rows, methods)}
    a.out.mkdir(parents=True, exist_ok=True)
    plot(cells, rows, methods, a.out)
    curves = [plot_curves(c, methods, a.out) for c in cells if c["cell"] in a.curves]
    command = " ".join(["python -m bench.harness.horizons", *(argv if argv is not None else sys.argv[1:])])
    (a.out / "report.md").write_text(markdown(report, cells, methods, command, curves))
    (a.out / "horizons.json").write_text(json.dumps(report, indent=1))
    print(a.out / "report.md")
    return report


if __name__ == "__main__":
    main()
