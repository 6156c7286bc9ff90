"""The AutoData report: leaderboard, feature and operation usage, failures, score-vs-trial plot.

``write_report([dir_a, dir_b, ...])`` reads each search's ``trials.jsonl`` (and ``final.json``) and
writes ``report.md`` and ``score_vs_trial.png`` into the first folder; further folders (e.g. the
same search with the random proposer) are compared by their best score after n trials.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

__all__ = ["TOP", "describe", "is_uniform", "load_trials", "plot", "running_best", "usage", "write_report"]

TOP = 10


def load_trials(folder: Path) -> list[dict[str, Any]]:
    path = folder / "trials.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"{folder} holds no trials.jsonl: not a search folder")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def is_uniform(recipe: dict | None) -> bool:
    return bool(recipe) and recipe.get("terms") == [] and recipe.get("backbone") == 1.0


def running_best(trials: list[dict[str, Any]]) -> np.ndarray:
    """Best (lowest) score after each trial; NaN until the first success."""
    scores = np.asarray([t["score"] if t["status"] == "ok" else np.inf for t in trials], dtype=float)
    best = np.minimum.accumulate(scores) if scores.size else scores
    return np.where(np.isfinite(best), best, np.nan)


def describe(recipe: dict) -> str:
    """One line: terms (±weight feature[shape]), combine, centring, rule, backbone."""
    if not recipe or "terms" not in recipe:
        return "program" if recipe else "-"
    if is_uniform(recipe):
        return "uniform random"
    terms = []
    for t in recipe["terms"]:
        name = ("log " if t.get("transform") == "log" else "") + t["feature"]
        mods = [m for m in (t.get("shape") if t.get("shape") != "linear" else None,
                            "cell" if t.get("aggregate") == "cell" else None,
                            "gated" if "gate" in t else None) if m]
        terms.append(f"{t['weight']:+.2f} {name}" + (f"[{','.join(mods)}]" if mods else ""))
    rule = recipe["rule"]
    params = ",".join(f"{k}={v}" for k, v in rule.items() if k != "kind")
    centre = f", centred κ={recipe['centre']['shrinkage']:g}" if recipe.get("centre") else ""
    return (f"{recipe['combine']}: {' '.join(terms)}{centre}; {rule['kind']}({params}); "
            f"backbone {recipe['backbone']:.2f}")


def usage(trials: list[dict[str, Any]]) -> tuple[Counter, Counter, Counter, Counter]:
    """Feature counts over successful trials and over the top ones; operation counts likewise."""
    ok = sorted((t for t in trials if t["status"] == "ok" and t["recipe"] and "terms" in t["recipe"]),
                key=lambda t: t["score"])
    feats_all, feats_top = Counter(), Counter()
    ops_all, ops_top = Counter(), Counter()
    for rank, t in enumerate(ok):
        feats = set(t.get("features", []))
        ops = {f"combine: {t['recipe']['combine']}", f"rule: {t['recipe']['rule']['kind']}",
               "backbone > 0" if t["recipe"]["backbone"] > 0 else "no backbone",
               "centred in cells" if t["recipe"].get("centre") else "not centred"}
        feats_all.update(feats)
        ops_all.update(ops)
        if rank < TOP:
            feats_top.update(feats)
            ops_top.update(ops)
    return feats_all, feats_top, ops_all, ops_top


def write_report(folders: list[Path], out: Path | None = None) -> Path:
    """report.md and score_vs_trial.png in ``out`` (default ``folders[0]``), leaderboard and usage of
    ``folders[0]``, the searches side by side; returns the report's path."""
    folders = [Path(f) for f in folders]
    runs = {f: load_trials(f) for f in folders}
    main = folders[0]
    out = Path(out) if out is not None else main
    trials = runs[main]
    final_path = main / "final.json"
    final = json.loads(final_path.read_text()) if final_path.exists() else None
    lines = [*_heading(main), *_searches(runs), *(_final_retraining(final) if final else []), *_leaderboard(trials),
             *_usage_tables(trials), *_failures(trials)]
    out.mkdir(parents=True, exist_ok=True)
    plot(runs, out / "score_vs_trial.png")
    lines += ["", "![score vs trial](score_vs_trial.png)", ""]
    path = out / "report.md"
    path.write_text("\n".join(lines))
    return path


def _heading(main: Path) -> list[str]:
    """The title and, when ``search.json`` is there, the search's settings."""
    lines = [f"# AutoData search: {main}", ""]
    settings = main / "search.json"
    if settings.exists():
        s = json.loads(settings.read_text())
        lines += [f"proposer `{s.get('proposer')}` · seed {s.get('seed')} · proxy seed {s.get('proxy_seed')} · "
                  f"{s.get('trial_tokens'):,} proxy tokens per trial · budget {s.get('budget')}", ""]
    return lines


def _searches(runs: dict[Path, list[dict[str, Any]]]) -> list[str]:
    """The searches side by side: one row per folder."""
    lines = ["## Searches", "",
             "Score: bits per byte of the target split under a fresh proxy trained on the recipe's subset "
             "(lower is better); *uniform* is the uniform-random recipe's trial; *retrained* is the exported "
             "winner's mean over the final proxy seeds; *mean after 8* is the mean score of trials 9 on "
             "(how good the proposals are, not just the luckiest).", "",
             "| search | proposer | trials | failed | uniform | best | best − uniform | best after 10 / 20 / 30 / 40 "
             "| retrained winner | mean after 8 |",
             "|---|---|---:|---:|---:|---:|---:|---|---:|---:|"]
    return lines + [_search_row(f, ts) for f, ts in runs.items()]


def _search_row(f: Path, ts: list[dict[str, Any]]) -> str:
    """One search's row of the searches table."""
    uni = [t["score"] for t in ts if t["status"] == "ok" and is_uniform(t["recipe"])]
    rb = running_best(ts)
    best = float(np.nanmin(rb)) if np.isfinite(rb).any() else float("nan")
    after = " / ".join(f"{rb[n - 1]:.4f}" if len(rb) >= n else "-" for n in (10, 20, 30, 40))
    failed = sum(t["status"] != "ok" for t in ts)
    u = f"{uni[0]:.4f}" if uni else "-"
    d = f"{best - uni[0]:+.4f}" if uni else "-"
    fin = f / "final.json"
    retrained = f"{json.loads(fin.read_text())['best']['mean']:.4f}" if fin.exists() else "-"
    later = [t["score"] for t in ts[8:] if t["status"] == "ok"]
    mean_late = f"{np.mean(later):.4f}" if later else "-"
    return (f"| {f} | {ts[0]['proposer'] if ts else '-'} | {len(ts)} | {failed} | {u} | {best:.4f} | {d} | "
            f"{after} | {retrained} | {mean_late} |")


def _final_retraining(final: dict[str, Any]) -> list[str]:
    """The top recipes' scores under the final proxy seeds and the exported winner (``final.json``)."""
    lines = ["", f"## Final retraining (proxy seeds {final['proxy_seeds']})", "",
             "| trial | scores | mean | recipe |", "|---:|---|---:|---|"]
    for r in final["top"]:
        lines.append(f"| {r['trial']} | {', '.join(f'{x:.4f}' for x in r['scores'])} | {r['mean']:.4f} | "
                     f"{describe(r['recipe'])} |")
    return lines + ["", f"Exported: `best_recipe.json` (trial {final['best']['trial']})."]


def _leaderboard(trials: list[dict[str, Any]]) -> list[str]:
    """The ``TOP`` best successful trials."""
    ok = sorted((t for t in trials if t["status"] == "ok"), key=lambda t: t["score"])
    lines = ["", f"## Leaderboard (top {TOP})", "", "| rank | trial | target bpb | recipe |", "|---:|---:|---:|---|"]
    for rank, t in enumerate(ok[:TOP], 1):
        lines.append(f"| {rank} | {t['trial']} | {t['score']:.4f} | {describe(t['recipe'])} |")
    return lines


def _usage_tables(trials: list[dict[str, Any]]) -> list[str]:
    """Feature and operation counts over the successful term recipes and over the top ones (:func:`usage`)."""
    feats_all, feats_top, ops_all, ops_top = usage(trials)
    n_ok = sum(1 for t in trials if t["status"] == "ok" and t["recipe"] and "terms" in t["recipe"])
    lines = ["", f"## Feature usage (of {n_ok} successful recipes / of the top {min(TOP, n_ok)})", "",
             "| feature | all | top |", "|---|---:|---:|"]
    for name, n in feats_all.most_common():
        lines.append(f"| {name} | {n} | {feats_top.get(name, 0)} |")
    lines += ["", "## Operations", "", "| operation | all | top |", "|---|---:|---:|"]
    for name, n in sorted(ops_all.items()):
        lines.append(f"| {name} | {n} | {ops_top.get(name, 0)} |")
    return lines


def _failures(trials: list[dict[str, Any]]) -> list[str]:
    """The failed trials with the first line of their error (nothing when none failed)."""
    failures = [t for t in trials if t["status"] != "ok"]
    if not failures:
        return []
    return ["", f"## Failed trials ({len(failures)})", "",
            *(f"- trial {t['trial']}: {str(t['error']).splitlines()[0][:200]}" for t in failures)]


def plot(runs: dict[Path, list[dict[str, Any]]], path: Path) -> None:
    """Each trial's score (dots; failed trials as x at the top) and the running best (line), per search."""
    fig, ax = plt.subplots(figsize=(7, 4))
    finite = [t["score"] for ts in runs.values() for t in ts if t["status"] == "ok"]
    top = max(finite) if finite else 1.0
    for k, (folder, ts) in enumerate(runs.items()):
        colour = f"C{k}"
        label = f"{ts[0]['proposer'] if ts else '?'} ({folder.name})"
        ok = [(t["trial"], t["score"]) for t in ts if t["status"] == "ok"]
        if ok:
            ax.scatter(*zip(*ok), s=12, color=colour, alpha=0.5)
        bad = [t["trial"] for t in ts if t["status"] != "ok"]
        if bad:
            ax.scatter(bad, [top] * len(bad), marker="x", color=colour, alpha=0.7)
        ax.plot(np.arange(len(ts)), running_best(ts), color=colour, label=f"best so far: {label}")
        uni = [t["score"] for t in ts if t["status"] == "ok" and is_uniform(t["recipe"])]
        if uni and k == 0:
            ax.axhline(uni[0], color="grey", ls="--", lw=1, label="uniform random recipe")
    ax.set_xlabel("trial")
    ax.set_ylabel("target bits per byte (proxy)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
