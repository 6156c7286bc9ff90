"""Turn results.json into report.md and plots: final bpb, tokens/wall-clock to random's loss, paired tests."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from bench.harness.intervals import t_half_width
from selection_callbacks.core.machine_load import ALONE_BELOW, describe_load

ORACLES = {False: "oracle", True: "oracle_offline"}
"""The labelled ceiling of each kind: online methods against the online oracle, offline ones against the offline."""


def crossing(curve: list[list[float]], target: float, column: int) -> float | None:
    """First value of ``column`` (0 = update tokens, 1 = wall seconds) at which val bpb ≤ target,
    linearly interpolated between evaluations; None if the curve never gets there."""
    prev = None
    for point in curve:
        if point[2] <= target:
            if prev is None or prev[2] == point[2]:
                return float(point[column])
            frac = (prev[2] - target) / (prev[2] - point[2])
            return float(prev[column] + frac * (point[column] - prev[column]))
        prev = point
    return None


def paired_test(diffs: list[float]) -> tuple[float, float, float]:
    """Mean, std and two-sided paired t-test p-value of per-seed differences (p = nan below 2 seeds)."""
    d = np.asarray(diffs, dtype=float)
    if d.size < 2:
        return float(d.mean()), float("nan"), float("nan")
    from scipy import stats

    std = float(d.std(ddof=1))
    p = float(stats.ttest_1samp(d, 0.0).pvalue) if std > 0 else (0.0 if d.mean() != 0 else 1.0)
    return float(d.mean()), std, p


def summarize(results: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per method: final bpb, paired differences against random and relative cost to reach random's final bpb."""
    methods = results["methods"]
    random_runs = {r["seed"]: r for r in methods["random"]["runs"]}
    out: dict[str, dict[str, Any]] = {}
    for name, entry in methods.items():
        runs = [r for r in entry["runs"] if r["seed"] in random_runs]
        finals = [r["final_val_bpb"] for r in runs]
        diffs = [r["final_val_bpb"] - random_runs[r["seed"]]["final_val_bpb"] for r in runs]
        tok_rel, wall_rel = [], []
        for r in runs:
            base = random_runs[r["seed"]]
            target = base["final_val_bpb"]
            t, w = crossing(r["curve"], target, 0), crossing(r["curve"], target, 1)
            tok_rel.append(None if t is None else t / base["curve"][-1][0])
            wall_rel.append(None if w is None else w / base["curve"][-1][1])
        mean_d, std_d, p = paired_test(diffs)
        out[name] = {
            "seeds": len(runs),
            "bpb_mean": float(np.mean(finals)),
            "bpb_std": float(np.std(finals, ddof=1)) if len(finals) > 1 else float("nan"),
            "diff_mean": mean_d,
            "diff_std": std_d,
            "p_value": p,
            "tokens_to_random": tok_rel,
            "wall_to_random": wall_rel,
            "step_time_ratio": float(np.mean([r.get("step_time_ratio", float("nan")) for r in runs])),
            "overhead_fraction": float(np.mean([r["overhead_fraction"] for r in runs])),
            "selection_seconds": float(np.mean([r["selection_seconds"] for r in runs])),
        }
    for name, s in out.items():  # each method against the ceiling of its kind
        ceiling = ORACLES[bool(methods[name].get("offline"))]
        if ceiling in out and name != "random":
            gain = -out[ceiling]["diff_mean"]
            s["oracle_share"] = (-s["diff_mean"] / gain) if gain > 0 else float("nan")
            s["oracle_kind"] = ceiling
    return out


def write_json(path: Path | None, obj: Any) -> None:
    """``obj`` as indented JSON at ``path`` (parents created); nothing when ``path`` is None."""
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(obj, indent=1))


def fmt_relative(values: list[float | None]) -> str:
    """Mean of the seeds that reached the target, with how many did when not all."""
    reached = [v for v in values if v is not None]
    if not reached:
        return "not reached"
    text = f"{np.mean(reached):.2f}×"
    return text if len(reached) == len(values) else f"{text} ({len(reached)}/{len(values)} seeds)"


def fmt_value(x: float, spec: str) -> str:
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def tuning_line(cfg: dict[str, Any]) -> str:
    """Whether the runs trained with a tuned baseline (``configs/tuned``) or were allowed without one."""
    if "tuned" not in cfg:
        return "Baseline tuning: not recorded (a comparison from before tuned baselines)."
    if cfg["tuned"] is None:
        return "**Untuned baseline**: run with `--allow-untuned`; no `bench.harness.tune` sweep set the learning rates."
    pairs = [line.strip() for line in cfg["tuned"].splitlines() if not line.lstrip().startswith("#")]
    values = ", ".join(pair for pair in pairs if pair.partition(":")[2].strip())
    return f"Baseline tuned by `bench.harness.tune` (`configs/tuned`): {values}."


def load_summary(results: dict[str, Any]) -> str:
    """One sentence: how many runs trained alone, how many beside other jobs, how many without a record."""
    others = [(r.get("machine") or {}).get("other_cpus") for e in results["methods"].values() for r in e["runs"]]
    recorded = [x for x in others if x is not None]
    if not recorded:
        return "Machine load: not recorded."
    beside = [x for x in recorded if x >= ALONE_BELOW]
    tail = f" (other work held {min(beside):.1f}–{max(beside):.1f} CPUs)" if beside else ""
    missing = len(others) - len(recorded)
    return (f"Machine load: {len(recorded) - len(beside)} of {len(others)} runs trained alone, {len(beside)} beside "
            f"other jobs{tail}" + (f", {missing} not recorded." if missing else "."))


def load_lines(results: dict[str, Any]) -> list[str]:
    """Which runs trained alone and which beside other jobs, from what each run recorded."""
    rows = []
    for name, entry in results["methods"].items():
        cells = []
        for r in entry["runs"]:
            m = r.get("machine") or {}
            loads = [x for _, x in m.get("load_average", []) if x is not None]
            span = f"; load {min(loads):.1f}–{max(loads):.1f}" if loads else ""
            cells.append(f"seed {r['seed']}: {describe_load(m.get('other_cpus'), m.get('cpus'))}{span}")
        rows.append(f"| {name} | " + "; ".join(cells) + " |")
    return ["Machine load while each run trained (other processes' mean CPUs from `/proc/stat`, and the range of "
            "the 1-minute load average, which counts the run's own threads): wall-clock columns compare fairly only "
            "between runs trained alone.", "", "| method | runs |", "|---|---|", *rows]


def report_markdown(results: dict[str, Any], summary: dict[str, dict[str, Any]]) -> str:
    cfg = results["config"]
    lines = [
        "# Method comparison",
        "",
        f"commit `{results['commit']}` · config `{results['config_hash']}` · {cfg['steps']} steps, "
        f"{cfg['tokens']:,} update tokens, ratio {cfg['ratio']}, optimizer {cfg['optimizer']}. "
        + tuning_line(cfg),
        "",
        "| method | seeds | val bpb | Δ vs random | p | tokens to random's bpb | wall to random's bpb | step time × | "
        "selection overhead | share of its oracle's gain |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, s in summary.items():
        lines.append(
            f"| {name} | {s['seeds']} | {s['bpb_mean']:.4f} ± {fmt_value(s['bpb_std'], '.4f')} | "
            f"{s['diff_mean']:+.4f} ± {fmt_value(s['diff_std'], '.4f')} | {fmt_value(s['p_value'], '.3f')} | "
            f"{fmt_relative(s['tokens_to_random'])} | {fmt_relative(s['wall_to_random'])} | {s['step_time_ratio']:.2f} | "
            f"{100 * s['overhead_fraction']:.1f}% | {fmt_value(s.get('oracle_share', float('nan')), '.0%')} |"
        )
    lines += [
        "",
        "Final val bits-per-byte (mean ± std over seeds). Δ is the paired difference against random "
        "(negative is better) with a two-sided paired t-test. *Tokens* and *wall* are the update tokens and "
        "training seconds (selection included) a method needs to reach random's final bpb, relative to random's "
        "full run (interpolated on the validation curves). The oracle share is the method's Δ over the Δ of the "
        "labelled oracle of its kind: `oracle` (online, the target's domains first in each superbatch) for online "
        "methods, `oracle_offline` (the target's domains first in the whole pool) for offline ones.",
        "",
    ]
    one_off = {name: [r.get("one_off_seconds", 0.0) for r in e["runs"]] for name, e in results["methods"].items()}
    one_off = {name: v for name, v in one_off.items() if any(v)}
    if one_off:
        lines += ["One-off seconds charged to the wall-clock columns (a prepare stage shared by every run on this pool "
                  "and seed, e.g. a reference loss table): " + "; ".join(
                      f"{name} {', '.join(f'{x:.0f}' for x in v)} s" for name, v in one_off.items()) + ".", ""]
    lines += [f"![{family}](curves_{family}.png)" for family in families(results)]
    lines += ["", load_summary(results), "", *load_lines(results), "", "Domain share of the kept candidates (whole run, mean over seeds):", ""]
    domains = sorted({d for e in results["methods"].values() for r in e["runs"] for d in r["domains"]})
    lines.append("| method | " + " | ".join(domains) + " |")
    lines.append("|---|" + "---:|" * len(domains))
    for name, entry in results["methods"].items():
        shares = [np.mean([r["domains"].get(d, 0.0) for r in entry["runs"]]) for d in domains]
        lines.append(f"| {name} | " + " | ".join(f"{100 * x:.1f}%" for x in shares) + " |")
    lines += ["", "![domain composition](domains_over_time.png)", ""]
    lines += diagnostics_lines(results)
    return "\n".join(lines)


def diagnostics_lines(results: dict[str, Any]) -> list[str]:
    """The table of the methods whose runs logged score diagnostics (OPUS, GREATS): means per seed."""
    keys = ("utility_split_half_mean", "sketch_error_mean")
    rows = []
    for name, entry in results["methods"].items():
        runs = [r for r in entry["runs"] if r.get("diagnostics")]
        if not runs:
            continue
        cells = [", ".join(fmt_value(r["diagnostics"].get(k), ".2f") for r in runs) for k in keys]
        modelled = ", ".join(fmt_value(r.get("modelled_step_ratio"), ".2f") for r in runs)
        rows.append(f"| {name} | {runs[0]['diagnostics'].get('checks', 0)} | {cells[0]} | {cells[1]} | {modelled} |")
    if not rows:
        return []
    return ["Score diagnostics per seed (means over the run's diagnostic selections): the split-half Spearman of "
            "the utilities (near 0: the scores rank candidates at random), the sketch's pair error, and the modelled "
            "step cost over a plain step (`bench/harness/cost_model.py`).", "",
            "| method | checks per run | split-half Spearman | sketch error | modelled step × |", "|---|---:|---|---|---|",
            *rows, ""]


REFERENCES = {"random": ("black", "-"), "oracle": ("0.45", "--"), "oracle_offline": ("0.45", ":")}
"""Drawn on every family's plot, in these colours and line styles."""


def families(results: dict[str, Any]) -> dict[str, list[str]]:
    """Method names by family (a method without one, e.g. in older results, is ``other``); references excluded.
    With references only, one ``baselines`` plot."""
    out: dict[str, list[str]] = {}
    for name, entry in results["methods"].items():
        if name not in REFERENCES:
            out.setdefault(entry.get("family") or "other", []).append(name)
    return out or {"baselines": []}


def seed_band(curves: list[np.ndarray], column: int) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """Mean x, mean bpb and the 95% t half-width of the mean bpb over seeds at each evaluation
    (curves share their evaluation grid); None for fewer than two seeds or unequal grids."""
    if len(curves) < 2 or len({c.shape for c in curves}) != 1:
        return None
    grid = np.stack([c[:, [column, 2]] for c in curves])
    n = grid.shape[0]
    half = t_half_width(grid[:, :, 1].std(0, ddof=1) / np.sqrt(n), n - 1)
    return grid[:, :, 0].mean(0), grid[:, :, 1].mean(0), half


def _draw(ax, entry: dict[str, Any], column: int, color, style: str, label: str) -> None:
    curves = [np.asarray(r["curve"], dtype=float) for r in entry["runs"]]
    band = seed_band(curves, column)
    if band is None:
        for i, c in enumerate(curves):
            ax.plot(c[:, column], c[:, 2], color=color, ls=style, lw=1.6, label=label if i == 0 else None)
        return
    x, y, half = band
    ax.plot(x, y, color=color, ls=style, lw=1.8, label=label)
    ax.fill_between(x, y - half, y + half, color=color, alpha=0.15, lw=0)


def plot(results: dict[str, Any], out: Path) -> None:
    """One figure per method family: val bpb against update tokens and against wall-clock, random and
    both oracles on each, bands the 95% interval of the seeds' mean, the legend outside the axes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = results["methods"]
    for family, names in families(results).items():
        fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
        palette = plt.get_cmap("tab10" if len(names) <= 10 else "tab20")
        for ax, (column, xlabel) in zip(axes, ((0, "update tokens"), (1, "training seconds (selection included)"))):
            for name, (color, style) in REFERENCES.items():
                if name in methods:
                    _draw(ax, methods[name], column, color, style, name)
            for i, name in enumerate(names):
                _draw(ax, methods[name], column, palette(i), "-", name)
            ax.set_xlabel(xlabel)
            ax.grid(alpha=0.3)
        axes[0].set_ylabel("val bits per byte")
        fig.suptitle(f"{family}: mean over {max(len(e['runs']) for e in methods.values())} seeds, "
                     "bands = 95% interval of the mean")
        axes[1].legend(loc="center left", bbox_to_anchor=(1.02, 0.5), fontsize=9)
        fig.tight_layout()
        fig.savefig(out / f"curves_{family}.png", dpi=110, bbox_inches="tight")
        plt.close(fig)
    _plot_domains(results, out, plt)


def _plot_domains(results: dict[str, Any], out: Path, plt) -> None:
    names = list(results["methods"])
    domains = sorted({d for e in results["methods"].values() for r in e["runs"] for _, c in r["domain_history"] for d in c})
    fig, axes = plt.subplots(1, len(names), figsize=(3.2 * len(names), 3.4), sharey=True, squeeze=False)
    for ax, name in zip(axes[0], names):
        runs = results["methods"][name]["runs"]
        history = runs[0]["domain_history"]
        if not history:
            ax.set_title(f"{name}\n(no record)")
            continue
        tokens = [h[0] for h in history]
        shares = np.zeros((len(domains), len(history)))
        for r in runs:
            prev = dict.fromkeys(domains, 0)
            for t, (_, counts) in enumerate(r["domain_history"][: len(history)]):
                delta = np.array([counts.get(d, 0) - prev.get(d, 0) for d in domains], dtype=float)
                shares[:, t] += delta / max(delta.sum(), 1.0) / len(runs)
                prev = counts
        ax.stackplot(tokens, shares, labels=domains)
        ax.set_title(name)
        ax.set_xlabel("update tokens")
        ax.set_ylim(0, 1)
    axes[0][0].set_ylabel("share of kept (per interval)")
    axes[0][-1].legend(loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "domains_over_time.png", dpi=110)
    plt.close(fig)


def write_report(results: dict[str, Any], out: Path) -> dict[str, dict[str, Any]]:
    summary = summarize(results)
    (out / "report.md").write_text(report_markdown(results, summary))
    plot(results, out)
    return summary


def build_parser():
    """The ``bench.harness.report`` flags."""
    from jsonargparse import ArgumentParser

    p = ArgumentParser(prog="python -m bench.harness.report",
                       description="Draw a comparison's plots (curves per method family, domains over time) from its results.json alone")
    p.add_argument("--results", type=Path, required=True, help="a bench.harness.compare results.json")
    p.add_argument("--out", type=Path, default=None, help="folder for the plots (default: the results.json's folder)")
    p.add_argument("--markdown", action="store_true", help="also rewrite report.md there")
    return p


def main(argv: list[str] | None = None) -> list[Path]:
    """``python -m bench.harness.report --results R --out DIR``: the plots (and with ``--markdown`` report.md); returns the files."""
    args = build_parser().parse_args(argv)
    results = json.loads(Path(args.results).read_text())
    out = Path(args.out) if args.out else Path(args.results).parent
    out.mkdir(parents=True, exist_ok=True)
    if args.markdown:
        write_report(results, out)
    else:
        plot(results, out)
    written = sorted(p for p in out.iterdir() if p.suffix == ".png" or (args.markdown and p.name == "report.md"))
    print("\n".join(str(p) for p in written))
    return written


if __name__ == "__main__":
    main()
