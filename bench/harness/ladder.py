"""Methods against tuned random across model sizes: the ladder report, its trends and the cost model's projection.

    R=bench/results
    python -m bench.harness.ladder --methods random,oracle,rho@score_len=16,classact,opus \
        --rung cpu-mini=$R/ladder/cpu-mini/results.json:$R/ladder/steptime-cpu-mini/steptime.json \
        --rung cpu-tiny=$R/default-adamw/results.json:$R/ladder/steptime-cpu-tiny/steptime.json \
        --rung cpu-small=$R/ladder/cpu-small/results.json:$R/ladder/steptime-cpu-small/steptime.json --out $R/ladder

A rung is ``NAME=RESULTS[:STEPTIME[,STEPTIME...]]``: its scale's name, a ``bench.harness.compare`` results.json and,
where measured, the ``bench.harness.steptime`` steptime.json files of that scale and the comparison's optimizer (without it the step and equal-wall
columns read "not measured"). Per rung it counts the learner's parameters from the scale the runs trained with
(results.json's ``config.scale``) and the update tokens per parameter. Per rung and method:

- Δ: final val bpb minus random's, paired by seed; its 95% t-interval over the paired differences
  (mean ± t₀.₉₇₅,ₙ₋₁ · s/√n) and the two-sided paired t-test's p (:func:`bench.harness.report.paired_test`), the
  oracle's Δ beside it;
- step ×: the in-run step-time ratio to random (:func:`bench.harness.equal_wall.step_time_ratio`, the median over
  repeats), and wall-clock to random's final bpb with one-offs amortised and charged
  (:func:`bench.harness.equal_wall.equal_wall`).

Across rungs, per method, a least-squares line of Δ (and of step ×) against log₁₀ parameters, its slope with
standard error and 95% interval. A rung named by ``--apart`` (another shape: sequence length, tokenizer or pool,
e.g. the long-shape rung ``cpu-tiny-t512``) stands in its own column of every table, after the others, and is left
out of the trends and of the plots against size. The cost model's check sets each method's modelled step ratio
(:mod:`bench.harness.cost_model`; calibrated by :mod:`bench.harness.pass_timing` where the step-time folder holds
its ``pass_timing.json``) against the measured one per rung, and splits a gradient method's gap into the parts
of its selection where the folder holds its ``ghost_parts.json`` (:mod:`bench.studies.ghost_parts`); the
projection carries each rung's modelled parts to ``--project`` (:func:`bench.harness.cost_model.projected_cost`).
Writes ``report.md``, ``ladder.json`` and ``delta_vs_params.png``, ``step_vs_params.png``,
``equal_wall_vs_params.png`` into ``--out``; the report's
"Which method at which size" section is left for a person to write from the data.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import json
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml
from jsonargparse import ArgumentParser

from bench.harness.compare import scale_config, split_variant
from bench.harness.cost_model import Shape, attention_flops_per_token, flops_per_token, projected_cost, proxy_config
from bench.harness.equal_wall import equal_wall, read_steptimes, step_time_ratio
from bench.harness.intervals import t_half_width
from bench.harness.methods import REGISTRY
from bench.harness.report import fmt_relative, fmt_value, paired_test
from bench.harness.train_child import ROOT
from selection_callbacks.nn.gpt import GPT, GPTConfig

NOT_MEASURED = "not measured"
PROXY_SLOWDOWN = 4.0
"""The projection's sensitivity: proxy passes charged this many times their FLOPs' share of the step."""
COUNTED_PARTS = ("forward", "backward", "utilities")
"""A ghost method's selection parts (:mod:`bench.studies.ghost_parts`) that the cost model counts as passes."""
LOSS_TOLERANCE = 0.1
"""The most a loss-based method's modelled step ratio may miss its measured one (RHO-LOSS, ClassAct: their
extra cost is passes the model counts)."""


def parse_rung(text: str) -> tuple[str, Path, list[Path]]:
    """``"cpu-mini=a/results.json:b/steptime.json"`` → ``("cpu-mini", a/results.json, [b/steptime.json])``; several
    step-time files of the rung are comma-separated (:func:`bench.harness.equal_wall.read_steptimes`)."""
    name, sep, files = text.partition("=")
    results, _, steptimes = files.partition(":")
    if not sep or not name or not results:
        raise SystemExit(f"--rung {text!r}: expected NAME=RESULTS[:STEPTIME[,STEPTIME...]]")
    return name, Path(results), [Path(p) for p in steptimes.split(",") if p]


def learner_config(scale: dict[str, Any]) -> GPTConfig:
    """The learner's :class:`GPTConfig` of a scale config: ``model.config`` with ``block_size`` = ``data.seq_len``
    (as train.py links them)."""
    config = (scale.get("model") or {}).get("config")
    if config is None:
        raise SystemExit("the ladder counts the built-in GPT's parameters: the scale names no model.config")
    return GPTConfig(**config, block_size=scale["data"]["seq_len"])


def count_params(config: GPTConfig) -> int:
    """The learner's parameters (embeddings and head included), built on the meta device."""
    with torch.device("meta"):
        return GPT(config).num_params()


def folder_files(steptime_paths: list[Path], name: str) -> dict[str, Any] | None:
    """The JSON files ``name`` beside a rung's steptime.json files (its calibration ``pass_timing.json``, its
    ``ghost_parts.json``), their ``methods`` in one (None where no folder holds one)."""
    found = [json.loads(p.read_text()) for p in (s.parent / name for s in steptime_paths) if p.exists()]
    if not found:
        return None
    return {**found[0], "methods": {k: v for f in found for k, v in (f.get("methods") or {}).items()}}


def load_rung(text: str) -> dict[str, Any]:
    """A rung's files, scale, learner, parameters and update tokens per parameter."""
    name, results_path, steptime_paths = parse_rung(text)
    results = json.loads(results_path.read_text())
    steptime = read_steptimes(steptime_paths) if steptime_paths else None
    timing, parts = (folder_files(steptime_paths, file) for file in ("pass_timing.json", "ghost_parts.json"))
    for key, trained in (("optimizer", results["config"]["optimizer"]), ("scale", name)):
        if steptime and steptime["config"].get(key) != trained:
            raise SystemExit(f"{name}: {steptime_paths[0]} timed {key} {steptime['config'].get(key)}, not {trained}")
    scale = yaml.safe_load(results["config"]["scale"])
    learner = learner_config(scale)
    params = count_params(learner)
    return {"name": name, "results_path": str(results_path),
            "steptime_path": ", ".join(str(p) for p in steptime_paths) or None,
            "results": results, "steptime": steptime, "timing": timing, "parts": parts, "scale": scale,
            "learner": learner, "params": params,
            "tokens": results["config"]["tokens"], "tokens_per_param": results["config"]["tokens"] / params}


def paired_cell(results: dict[str, Any], name: str) -> dict[str, Any] | None:
    """Per common seed, the method's final val bpb and its difference to random's; mean, 95% interval and p
    (None when the comparison did not run the method)."""
    if name not in results["methods"]:
        return None
    random = {r["seed"]: r["final_val_bpb"] for r in results["methods"]["random"]["runs"]}
    runs = sorted((r for r in results["methods"][name]["runs"] if r["seed"] in random), key=lambda r: r["seed"])
    diffs = [r["final_val_bpb"] - random[r["seed"]] for r in runs]
    mean, std, p = paired_test(diffs)
    half = t_half_width(std / math.sqrt(max(len(diffs), 1)), len(diffs) - 1)  # mean ± t₀.₉₇₅,ₙ₋₁ · s/√n
    return {"seeds": [r["seed"] for r in runs], "bpb": [r["final_val_bpb"] for r in runs], "diffs": diffs,
            "diff_mean": mean, "diff_std": std, "ci": (mean - half, mean + half), "p_value": p}


def step_values(timed: dict[str, Any]) -> list[float]:
    """The per-repeat step ratios behind :func:`step_time_ratio`: in-run where the timing has them."""
    return timed["ratios"] if timed.get("in_run_ratio_median") is None else timed["in_run_ratios"]


def rung_cells(rung: dict[str, Any], methods: list[str]) -> dict[str, dict[str, Any] | None]:
    """Per method: its paired cell with the oracle's Δ and, where the rung's timing has it, its step ratios
    and wall-clock to random's final bpb (amortised and charged)."""
    results, steptime = rung["results"], rung["steptime"]
    walls = equal_wall(results, steptime) if steptime else {}
    oracle = paired_cell(results, "oracle")
    cells = {}
    for name in methods:
        cell = paired_cell(results, name)
        if cell is not None:
            timed = (steptime or {}).get("methods", {}).get(name)
            cell["oracle_diff"] = None if oracle is None else oracle["diff_mean"]
            cell["step"] = None if timed is None else step_time_ratio(timed)
            cell["step_values"] = None if timed is None else step_values(timed)
            cell["in_run"] = None if timed is None else timed.get("in_run_ratio_median") is not None
            wall = walls.get(name)
            cell["wall"] = None if wall is None else wall["wall_to_random"]
            cell["wall_charged"] = None if wall is None else wall["wall_to_random_charged"]
        cells[name] = cell
    return cells


def trend(x: list[float], y: list[float]) -> dict[str, Any]:
    """Least squares y = a + b·x: slope b, its standard error √(SSR/(n−2) / Σ(x−x̄)²) and 95% t-interval
    with n − 2 degrees of freedom (nan where they are 0 or x does not vary)."""
    x_, y_ = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    n = x_.size
    if n < 2 or np.ptp(x_) == 0:
        return {"n": int(n), "slope": float("nan"), "intercept": float("nan"), "se": float("nan"),
                "ci": (float("nan"), float("nan"))}
    slope, intercept = np.polyfit(x_, y_, 1)
    df = n - 2
    ssr = float(np.sum((y_ - (intercept + slope * x_)) ** 2))
    se = math.sqrt(ssr / df / np.sum((x_ - x_.mean()) ** 2)) if df > 0 else float("nan")
    half = t_half_width(se, df)
    return {"n": int(n), "slope": float(slope), "intercept": float(intercept), "se": se,
            "ci": (slope - half, slope + half)}


def method_trends(rungs: list[dict[str, Any]], cells: dict[str, dict[str, Any]], name: str) -> dict[str, Any]:
    """A method's lines against log₁₀ parameters: Δ over every seed's value, Δ over the rung means, and the step
    ratio over every repeat's value."""
    points: dict[str, tuple[list[float], list[float]]] = {"delta": ([], []), "delta_means": ([], []), "step": ([], [])}
    for rung in rungs:
        cell, x = cells[rung["name"]][name], math.log10(rung["params"])
        if cell is None:
            continue
        for key, values in (("delta", cell["diffs"]), ("delta_means", [cell["diff_mean"]]),
                            ("step", cell["step_values"] or [])):
            points[key][0].extend([x] * len(values))
            points[key][1].extend(values)
    return {key: {**trend(*xy), "rungs": len({*xy[0]})} for key, xy in points.items()}


def method_settings(name: str) -> dict[str, Any]:
    """The selection callback's arguments a method runs with: the class defaults (over its MRO), its
    ``configs/method`` YAML, then the variant's ``@arg=value`` overrides."""
    base, extra = split_variant(name)
    if base not in REGISTRY or REGISTRY[base].config is None:
        raise SystemExit(f"{name}: not an online method of bench.harness.methods")
    selection = yaml.safe_load((ROOT / REGISTRY[base].config).read_text())["selection"]
    module, _, cls = selection["class_path"].rpartition(".")
    settings: dict[str, Any] = {}
    for klass in reversed(getattr(importlib.import_module(module), cls).__mro__):
        if "__init__" in vars(klass):
            params = inspect.signature(klass.__init__).parameters.values()
            settings.update({p.name: p.default for p in params if p.default is not inspect.Parameter.empty})
    return {**settings, **(selection.get("init_args") or {}), **{k: yaml.safe_load(v) for k, v in extra}}


def method_shape(name: str, learner: GPTConfig, seq_len: int) -> tuple[Shape, int | None]:
    """The method's :class:`Shape` beside ``learner`` (its proxies at the method's own layers × width) and its
    scoring window (``score_len``; None: whole sequences)."""
    s = method_settings(name)
    return Shape(learner, seq_len, proxy_config(learner, s)), s.get("score_len")


def target_shape(scale: str) -> dict[str, Any]:
    """The projection's target: its name, learner, T and batch from ``configs/scale/<scale>.yaml``."""
    config = yaml.safe_load(scale_config(scale).read_text())
    return {"name": scale, "learner": learner_config(config), "seq_len": config["data"]["seq_len"],
            "batch": config["data"]["batch_size"]}


def family(name: str) -> str:
    """The method's family in :data:`bench.harness.methods.REGISTRY` (``loss``, ``gradient``, ``reference``...)."""
    return REGISTRY[split_variant(name)[0]].family


def cost_check(rungs: list[dict[str, Any]], methods: list[str]) -> list[dict[str, Any]]:
    """Per rung and timed method: the FLOP-modelled step ratio, the calibrated one (its passes at this host's
    per-model seconds, :mod:`bench.harness.pass_timing`; None where the rung has no ``pass_timing.json``), the
    measured one and the error (measured − the calibrated ratio where there is one, else the FLOP-modelled one),
    with the passes' share of the measured extra (measured − 1) and the rest they do not explain."""
    rows = []
    for rung in rungs:
        timed = (rung["steptime"] or {}).get("methods", {})
        timing = (rung["timing"] or {}).get("methods", {})
        for name in (m for m in methods if m in timed and m != "random"):
            measured, flops = step_time_ratio(timed[name]), timed[name]["modelled_ratio"]
            calibrated = timing[name]["ratio"] if name in timing else None
            modelled = flops if calibrated is None else calibrated
            error = measured - modelled
            rows.append({"rung": rung["name"], "method": name, "family": family(name), "flops": flops,
                         "calibrated": calibrated, "modelled": modelled,
                         "measured": measured, "in_run": timed[name].get("in_run_ratio_median") is not None,
                         "error": error, "parts": timed[name]["modelled_parts"],
                         "passes_share": (modelled - 1) / (measured - 1) if measured > 1 else float("nan"),
                         "exceeds": family(name) == "loss" and abs(error) > LOSS_TOLERANCE})
    return rows


def gap_parts(rungs: list[dict[str, Any]], check: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per rung and ghost method with a ``ghost_parts.json`` and a calibrated ratio: its measured − calibrated gap from
    the check, split with its selection's parts (:mod:`bench.studies.ghost_parts`), all over the re-run's in-run
    denominator: the counted passes as they ran (forward, backward, utilities) less their calibrated seconds, the
    parts the cost model leaves out, random's selection (which the in-run ratio charges random), and the rest:
    the step-time run and the calibration against the re-run, which ran in other processes."""
    gaps = {(r["rung"], r["method"]): r for r in check}
    rows = []
    for rung in rungs:
        for name, m in ((rung["parts"] or {}).get("methods") or {}).items():
            checked = gaps.get((rung["name"], name))
            if checked is None or checked["calibrated"] is None:
                continue
            passes = m["counted_share"] - m["calibrated_share"]
            random_selection = m["random_selection_seconds"] / m["base_seconds"]
            rows.append({"rung": rung["name"], "method": name, "gap": checked["error"], "passes": passes,
                         "left_out": {k: v for k, v in m["shares"].items() if k not in COUNTED_PARTS},
                         "left_out_total": m["left_out_share"], "random_selection": random_selection,
                         "other_processes": checked["error"] - passes - m["left_out_share"] + random_selection})
    return rows


def projection(rungs: list[dict[str, Any]], methods: list[str], target: dict[str, Any]) -> dict[str, Any]:
    """Per method, from each rung that timed it: its modelled step ratio at ``target`` (matmul FLOPs only, and with
    attention) and the rung's measured − modelled gap; with the numbers the projection assumes."""
    out: dict[str, Any] = {}
    for name in methods:
        out[name] = {}
        for rung in rungs:
            timed = (rung["steptime"] or {}).get("methods", {}).get(name)
            if timed is None:
                continue
            source, window = method_shape(name, rung["learner"], rung["scale"]["data"]["seq_len"])
            goal = Shape(target["learner"], target["seq_len"], source.proxy and dataclasses.replace(
                source.proxy, vocab_size=target["learner"].vocab_size, block_size=target["seq_len"]))
            attention = projected_cost(timed["modelled_parts"], window, source, goal)
            proxy_share = sum(v for k, v in attention["parts"].items() if not k.startswith("learner"))
            out[name][rung["name"]] = {
                "matmul": projected_cost(timed["modelled_parts"], window, source, goal, attention=False)["ratio"],
                "attention": attention["ratio"],
                "proxy_share": proxy_share,
                "slow_proxies": attention["ratio"] + (PROXY_SLOWDOWN - 1) * proxy_share,
                "gap": step_time_ratio(timed) - timed["modelled_ratio"], "window": window,
                "passes": bool(timed["modelled_parts"]),
                "proxy": None if source.proxy is None else f"{source.proxy.n_layer}×{source.proxy.n_embd}"}
    learner, seq_len = target["learner"], target["seq_len"]
    matmul, attention = flops_per_token(learner, 0, False), attention_flops_per_token(learner, seq_len)
    return {"target": {"name": target["name"], "layers": learner.n_layer, "width": learner.n_embd, "seq_len": seq_len,
                       "vocab": learner.vocab_size,
                       "batch": target["batch"], "params": count_params(learner), "matmul_flops": matmul,
                       "attention_flops": attention, "attention_share": attention / (matmul + attention)},
            "source_batches": {r["name"]: r["scale"]["data"]["batch_size"] for r in rungs}, "methods": out}


def values(xs: list[float] | None, spec: str = ".4f") -> str:
    """``"3.1234, 3.2001"``; "–" for none."""
    return "–" if not xs else ", ".join(format(x, spec) for x in xs)


def rung_label(rung: dict[str, Any]) -> str:
    """The rung's name, marked when it stands apart from the trends."""
    return rung["name"] + (" (apart)" if rung.get("apart") else "")


def rung_lines(rungs: list[dict[str, Any]]) -> list[str]:
    """The rungs' table and the sentence on their tokens per parameter (over the rungs of the trends)."""
    lines = ["| rung | learner (layers × width, T) | parameters | update tokens | tokens per parameter | comparison | "
             "step times |", "|---|---|---:|---:|---:|---|---|"]
    for r in rungs:
        c = r["learner"]
        lines.append(f"| {rung_label(r)} | {c.n_layer} × {c.n_embd}, T = {c.block_size} | {r['params']:,} | "
                     f"{r['tokens']:,} | {r['tokens_per_param']:.1f} | `{r['results_path']}` | "
                     f"{'`' + r['steptime_path'] + '`' if r['steptime_path'] else NOT_MEASURED} |")
    sized = [r for r in rungs if not r.get("apart")] or rungs
    low, high = min(sized, key=lambda r: r["tokens_per_param"]), max(sized, key=lambda r: r["tokens_per_param"])
    apart = [r["name"] for r in rungs if r.get("apart")]
    note = ([f"Apart: {', '.join(apart)}, of another shape (sequence length, tokenizer or pool): in every table, "
             "left out of the trends and plots against size."] if apart else [])
    return lines + ["", "Parameters count every weight of the learner (embeddings and head included), built from "
                    "the scale each comparison trained with (its results.json's `config.scale`). Every rung trains on "
                    "the same update tokens, so the rungs differ in tokens per parameter: from "
                    f"{high['tokens_per_param']:.1f} ({high['name']}) to "
                    f"{low['tokens_per_param']:.1f} ({low['name']}). "
                    "A trend across them mixes model size with how long each model trains for its size.", *note]


def ladder_lines(rungs: list[dict[str, Any]], cells: dict[str, dict[str, Any]], methods: list[str]) -> list[str]:
    """One row per method and rung: per-seed values, the paired Δ with its interval and p, the oracle's Δ,
    the step ratio and the equal-wall crossings."""
    lines = ["| method | rung | parameters | seeds | val bpb per seed | Δ per seed | Δ vs random [95% interval] | p | "
             "oracle Δ | step × | wall to random's bpb, one-offs amortised | one-offs charged |",
             "|---|---|---:|---|---|---|---|---:|---:|---:|---:|---:|"]
    for name in methods:
        sized = any(cells[r["name"]][name] is not None for r in rungs if not r.get("apart"))
        for rung in rungs:
            c = cells[rung["name"]][name]
            head = f"| {name} | {rung_label(rung)} | {rung['params']:,} |"
            if c is None:
                if sized:  # a method that only apart rungs ran has rows where it ran
                    lines.append(f"{head} not run |" + " |" * 8)
                continue
            lo, hi = c["ci"]
            step = NOT_MEASURED if c["step"] is None else f"{c['step']:.2f}" + ("" if c["in_run"] else " (run vs run)")
            walls = ([NOT_MEASURED] * 2 if c["wall"] is None else
                     [fmt_relative(c["wall"]), fmt_relative(c["wall_charged"])])
            lines.append(f"{head} {values(c['seeds'], 'd')} | {values(c['bpb'])} | {values(c['diffs'], '+.4f')} | "
                         f"{c['diff_mean']:+.4f} [{fmt_value(lo, '+.4f')}, {fmt_value(hi, '+.4f')}] | "
                         f"{fmt_value(c['p_value'], '.3f')} | {fmt_value(c['oracle_diff'], '+.4f')} | {step} | "
                         f"{walls[0]} | {walls[1]} |")
    return lines + ["", "Δ: final val bits per byte minus random's on the same seed (negative is better), its mean "
                    "with the 95% t-interval over the paired differences and the two-sided paired t-test's p. "
                    "Oracle Δ: the "
                    "online oracle's mean Δ on the same rung. Step ×: the method's step time over random's, the median "
                    "over the interleaved repeats of the in-run ratio (`bench.harness.steptime`). Wall to random's "
                    "bpb: "
                    "step × times the update tokens the method needs to reach random's final bpb, over random's "
                    "(`bench.harness.equal_wall`; charged adds the one-off start-up and prepare costs as a fraction of "
                    "random's run)."]


def slope_text(t: dict[str, Any], spec: str) -> str:
    """``"-0.012 ± 0.004 [-0.021, -0.003] (9 points, 3 rungs)"``; "–" without a slope."""
    if math.isnan(t["slope"]):
        return f"– ({t['n']} points, {t['rungs']} rung(s))"
    return (f"{t['slope']:{spec}} ± {fmt_value(t['se'], spec.lstrip('+'))} [{fmt_value(t['ci'][0], spec)}, "
            f"{fmt_value(t['ci'][1], spec)}] ({t['n']} points, {t['rungs']} rung(s))")


def trend_lines(trends: dict[str, dict[str, Any]], rungs: int) -> list[str]:
    """The slopes' table and what three sizes can carry."""
    lines = ["| method | Δ per decade of parameters ± SE [95%], every seed | Δ per decade, rung means | "
             "step × per decade ± SE [95%], every repeat |", "|---|---|---|---|"]
    for name, t in trends.items():
        if not t["delta"]["rungs"]:  # run on apart rungs only
            continue
        lines.append(f"| {name} | {slope_text(t['delta'], '+.4f')} | {slope_text(t['delta_means'], '+.4f')} | "
                     f"{slope_text(t['step'], '+.3f')} |")
    return lines + ["", f"Least-squares lines against log₁₀ parameters. The ladder has {rungs} sizes: the first "
                    "interval takes every seed as a point (n − 2 degrees of freedom), as if seeds at one size were "
                    "independent evidence about a slope, which they are not; the rung means' interval has "
                    f"{max(rungs - 2, 0)} degree(s) of freedom and is the honest width. A slope says at most which way "
                    "a method moves over this range, and only where the rung means' interval leaves out 0."]


def check_lines(rows: list[dict[str, Any]]) -> list[str]:
    """The cost model's check: modelled against measured step ratio per rung and method."""
    if not rows:
        return [f"No rung has a step-time file: the check is {NOT_MEASURED}."]
    lines = ["| rung | method | FLOP-modelled × | calibrated × | measured × | measured − calibrated | FLOP parts | "
             "passes' share of the measured extra | check |", "|---|---|---:|---:|---:|---:|---|---:|---|"]
    for r in rows:
        parts = ", ".join(f"{k} {v:.3f}" for k, v in r["parts"].items()) or "none"
        check = (("**exceeds 0.1**" if r["exceeds"] else "within 0.1") if r["family"] == "loss" else
                 f"{r['error']:+.2f} not in the passes: {fmt_value(1 - r['passes_share'], '.0%')} of the extra")
        calibrated = NOT_MEASURED if r["calibrated"] is None else f"{r['calibrated']:.3f}"
        lines.append(f"| {r['rung']} | {r['method']} | {r['flops']:.3f} | {calibrated} | {r['measured']:.3f}"
                     f"{'' if r['in_run'] else ' (run vs run)'} | {r['error']:+.3f} | {parts} | "
                     f"{fmt_value(r['passes_share'], '.0%')} | {check} |")
    return lines + ["", "FLOP-modelled: 1 + the selector's counted passes, each weighed by its model's matmul FLOPs per "
                    "token over the training step's (`bench/harness/cost_model.py`). Calibrated: the same passes at "
                    "their seconds on this host, each model timed at the run's shapes with the learner's plain step "
                    "in the same process, the median over rounds in fresh processes (`bench/harness/pass_timing.py`); "
                    "the error is measured − "
                    "calibrated (measured − FLOP-modelled where a rung was not calibrated). Measured: the in-run ratio "
                    "of the step-time file. The loss-based methods' extra cost is passes, and their error is held to "
                    f"{LOSS_TOLERANCE}. A gradient method's measured extra (measured − 1) is its passes (the modelled "
                    "parts: the scoring forward and the ghost backward) plus work the model does not count: the "
                    "sketch's projections, the optimizer map applied to the factors, the sampling and redundancy "
                    "penalty, hooks, host syncs and Python; the last column gives that remainder and its share."]


def gap_lines(rows: list[dict[str, Any]]) -> list[str]:
    """A ghost method's measured − calibrated gap per rung, part by part."""
    if not rows:
        return ["No rung has a `ghost_parts.json` (`python -m bench.studies.ghost_parts FOLDER`) and a calibration: "
                "the gap is not split."]
    names = list(rows[0]["left_out"])
    lines = ["| rung | method | measured − calibrated | = counted passes as run − calibrated | + left out | "
             "− random's selection | + other processes | " + " | ".join(n.replace("_", " ") for n in names) + " |",
             "|---|---|" + "---:|" * (5 + len(names))]
    for r in rows:
        terms = (r["gap"], r["passes"], r["left_out_total"])
        lines.append(f"| {r['rung']} | {r['method']} | " + " | ".join(f"{t:+.3f}" for t in terms)
                     + f" | {r['random_selection']:.3f} | {r['other_processes']:+.3f} | "
                     + " | ".join(f"{r['left_out'][n]:.3f}" for n in names) + " |")
    return lines + [
        "", "Each term is in step-ratio units: seconds over the in-run ratio's denominator of a re-run of the ghost "
        "method's step-time run with a timer on each part of its selection (`bench/studies/ghost_parts.py`: the "
        "same config, steps and thread), and the terms add up to measured − calibrated. Counted passes as run: the "
        "scoring forward, the capture's backward (activation gradients) and the utilities Σ_t b_tᵀ Q a_t (the "
        "backward's second unit in the cost model, in place of the weight gradient), less the calibrated seconds of "
        "the same passes. Left out, the sum of the parts after it: per layer group as its gradients arrive, the "
        "factors, the maps (the target direction, the optimizer's map read from its state, Q = −Jᵀḡ), the sketches "
        "of P G_i (which, where AdamW's map is far from rank one, form each P G_i and read the utilities from it, "
        "so there the utilities are timed with the sketches) and the rest of the layer scoring; then grouping the "
        "layers, collecting the passes, building the step's map object, drawing the windows and target rows, "
        "calibrating the utilities (the sketches' Gram matrix), the sampling with its redundancy penalty, and the "
        "rest of the selection (its recorded seconds less the timed parts). Other processes: what is left, the "
        "step-time runs' in-run ratio and the calibration's plain step against the re-run's, which ran in other "
        "processes and, where the step-time runs shared the host, under other load."]


def projection_lines(proj: dict[str, Any]) -> list[str]:
    """The projection's table and the assumptions it rests on, each with its number."""
    t = proj["target"]
    lines = [f"| method | window | proxies | from rung | modelled × at {t['name']}, matmul only | with attention | "
             f"with attention, proxies at 1/{PROXY_SLOWDOWN:g} of the learner's FLOP rate | "
             "measured − modelled at that rung |", "|---|---:|---|---|---:|---:|---:|---:|"]
    for name, sources in proj["methods"].items():
        if not sources:
            lines.append(f"| {name} | | | no rung timed it | {NOT_MEASURED} | {NOT_MEASURED} | {NOT_MEASURED} | |")
        for rung, p in sources.items():
            bound = " (lower bound)" if family(name) == "gradient" else ""
            window = "–" if not p["passes"] else p["window"] or "whole sequence"
            lines.append(f"| {name} | {window} | {p['proxy'] or 'none'} | {rung} | "
                         f"{p['matmul']:.3f}{bound} | {p['attention']:.3f}{bound} | {p['slow_proxies']:.3f}{bound} | "
                         f"{p['gap']:+.3f} |")
    batches = ", ".join(f"{k} {v}" for k, v in proj["source_batches"].items())
    return lines + ["", f"A projection, not a measurement: no run at {t['name']} backs it. It carries each rung's "
                    "modelled parts to the target (`bench.harness.cost_model.projected_cost`) and assumes:", "",
                    f"- the learner at {t['name']}: {t['layers']} × {t['width']}, T = {t['seq_len']}, "
                    f"{t['params']:,} parameters, vocabulary {t['vocab']:,} (the byte-level tokenizer's, so the "
                    f"proxies' output heads stay small); {t['matmul_flops']:,} matmul FLOPs per forward token and "
                    f"{t['attention_flops']:,} of causal attention (2·layers·T·width), attention "
                    f"{t['attention_share']:.0%} of the step; the 'matmul only' column leaves attention out;",
                    "- attention is counted for a kernel that skips the masked half (flash-style); one that computes "
                    "the whole square doubles it;",
                    "- every pass runs at the training step's FLOP efficiency. On a GPU a 128-wide proxy's matmuls run "
                    "well below a 768-wide learner's, so the proxies' share is understated; the column before the last "
                    f"charges every proxy pass {PROXY_SLOWDOWN:g}× its FLOPs' share (a sensitivity, not a measurement; "
                    "each rung's `pass_timing.json` holds the seconds its proxies' passes took on this CPU);",
                    "- proxies stay at each method's defaults (the proxies column), their context T; scoring windows "
                    "keep their length, so a windowed pass shrinks per update token by the rung's T over the target's;",
                    f"- a pass's rows grow with the batch (batch {t['batch']} at the target; {batches} at the rungs);",
                    "- the cost model leaves out what a ghost method does besides its passes (sketches, maps, "
                    "sampling, host syncs, Python): a gradient method's projection is a lower bound, and its "
                    "measured − modelled "
                    "gap at each rung stands beside it."]


PLOTS = {
    "delta": ("delta_vs_params.png", "Δ final val bpb vs random (negative is better)", 0.0, "delta"),
    "step": ("step_vs_params.png", "step time × random (in-run)", 1.0, "step"),
    "wall": ("equal_wall_vs_params.png", "wall-clock to random's final bpb × random's", 1.0, None),
}
"""Per figure: its file, y label, random's level and the trend it draws."""


def series(cell: dict[str, Any] | None, kind: str) -> tuple[list[float], float, tuple[float, float] | None]:
    """A cell's points on one figure (seeds or repeats), its centre and its interval (Δ only); nothing unmeasured."""
    if cell is None:
        return [], float("nan"), None
    if kind == "delta":
        return cell["diffs"], cell["diff_mean"], cell["ci"]
    if kind == "step":
        return cell["step_values"] or [], float("nan") if cell["step"] is None else cell["step"], None
    reached = [w for w in cell["wall"] or [] if w is not None]
    return reached, float(np.mean(reached)) if reached else float("nan"), None


def plot(rungs: list[dict[str, Any]], cells: dict[str, dict[str, Any]], trends: dict[str, dict[str, Any]],
         out: Path) -> list[Path]:
    """The three figures against parameters (log axis): each seed's (or repeat's) point, the rung's centre (Δ: the
    mean with its 95% interval), the fitted trend, random's level as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names, written = list(trends), []
    params = np.array([r["params"] for r in rungs], dtype=float)
    for kind, (file, ylabel, level, fitted) in PLOTS.items():
        fig, ax = plt.subplots(figsize=(7.5, 4.4))
        ax.axhline(level, color="black", lw=0.8, label="random")
        for i, name in enumerate(names):
            color, nudge = plt.get_cmap("tab10")(i % 10), 10 ** (0.025 * (i - (len(names) - 1) / 2))
            centres = []
            for rung, x in zip(rungs, params * nudge):
                points, centre, band = series(cells[rung["name"]][name], kind)
                ax.scatter([x] * len(points), points, color=color, s=14, alpha=0.45, lw=0)
                if band is not None and not math.isnan(band[0]):
                    ax.errorbar([x], [centre], yerr=[[centre - band[0]], [band[1] - centre]], color=color, capsize=3)
                centres.append((x, centre))
            ax.plot(*zip(*centres), "o", color=color, label=name)
            line = trends[name][fitted] if fitted else None
            if line is not None and not math.isnan(line["slope"]):
                grid = np.linspace(np.log10(params.min()), np.log10(params.max()), 20)
                ax.plot(10 ** grid, line["intercept"] + line["slope"] * grid, "--", color=color, lw=1)
        ax.set_xscale("log")
        ax.minorticks_off()
        ax.set_xlim(params.min() / 1.5, params.max() * 1.5)
        ax.set_xticks(params, [f"{r['name']}\n{r['params'] / 1e6:.2f}M" for r in rungs])
        ax.set_xlabel("learner parameters")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(loc="center left", bbox_to_anchor=(1.02, 0.5), fontsize=9)
        ax.set_title("points: seeds (step: repeats); " + ("bars: 95% interval; " if kind == "delta" else "")
                     + ("dashed: least-squares trend" if fitted else
                        "markers: mean of the seeds that reached it, one-offs amortised")
                     + ("" if kind == "delta" else "; none where a rung has no step times"),
                     fontsize=9)
        fig.tight_layout()
        fig.savefig(out / file, dpi=110, bbox_inches="tight")
        plt.close(fig)
        written.append(out / file)
    return written


def markdown(report: dict[str, Any], rungs: list[dict[str, Any]], methods: list[str], command: str) -> str:
    """report.md: rungs, the ladder table, trends, plots, the cost model's check, the projection, and the
    recommendation's heading left for a person."""
    lines = ["# Methods across model sizes (the ladder)", "", f"`{command}`", "", "## Rungs", "",
             *rung_lines(rungs), "", "## Methods against tuned random at each size", "",
             *ladder_lines(rungs, report["cells"], methods), "", "## Trends against size", "",
             *trend_lines(report["trends"], sum(not r["apart"] for r in rungs)), "", "## Plots", "",
             *[f"![{ylabel}]({file})" for file, ylabel, _, _ in PLOTS.values()], "",
             "## The cost model against measured step times", "", *check_lines(report["cost_check"]), "",
             "### A gradient method's gap, part by part", "", *gap_lines(report["gap_parts"]), "",
             f"## Step time at {report['projection']['target']['name']}: a projection", "",
             *projection_lines(report["projection"]), "", "## Which method at which size", "",
             "<!-- Written by hand from the tables above once every rung is in; "
             "bench.harness.ladder leaves it empty. -->"]
    return "\n".join(lines) + "\n"


def build_parser() -> ArgumentParser:
    """The ``bench.harness.ladder`` flags."""
    p = ArgumentParser(prog="python -m bench.harness.ladder", description=__doc__.split("\n\n")[0])
    p.add_argument("--rung", action="append", required=True,
                   help="NAME=RESULTS[:STEPTIME]: a comparison's results.json and its step-time file; repeat per rung")
    p.add_argument("--methods", required=True, help="comma-separated, random first; name@arg=value variants")
    p.add_argument("--apart", action="append", default=[],
                   help="a rung NAME of another shape: in every table, left out of the trends and plots; repeat per rung")
    p.add_argument("--project", default="gpu-gpt2", help="the scale the cost model projects step ratios to")
    p.add_argument("--out", type=Path, required=True, help="folder of report.md, ladder.json and the plots")
    return p


def main(argv: list[str] | None = None) -> dict[str, Any]:
    a = build_parser().parse_args(argv)
    methods = [m.strip() for m in a.methods.split(",") if m.strip()]
    if "random" not in methods:
        raise SystemExit("the ladder is against random: include 'random' in --methods")
    rungs = [{**r, "apart": r["name"] in a.apart} for r in (load_rung(text) for text in a.rung)]
    unknown = sorted(set(a.apart) - {r["name"] for r in rungs})
    if unknown:
        raise SystemExit(f"--apart {unknown}: no --rung has that name")
    rungs.sort(key=lambda r: (r["apart"], r["params"]))
    sized = [r for r in rungs if not r["apart"]]
    cells = {r["name"]: rung_cells(r, methods) for r in rungs}
    trends = {m: method_trends(sized, cells, m) for m in methods if m != "random"}
    check = cost_check(rungs, methods)
    report = {"rungs": [{k: (dataclasses.asdict(v) if k == "learner" else v) for k, v in r.items()
                         if k not in ("results", "steptime", "scale", "parts")} for r in rungs],
              "cells": cells, "trends": trends, "cost_check": check, "gap_parts": gap_parts(rungs, check),
              "projection": projection(rungs, methods, target_shape(a.project))}
    a.out.mkdir(parents=True, exist_ok=True)
    command = " ".join(["python -m bench.harness.ladder", *(argv if argv is not None else sys.argv[1:])])
    (a.out / "report.md").write_text(markdown(report, rungs, methods, command))
    (a.out / "ladder.json").write_text(json.dumps(report, indent=1))
    plot(sized, cells, trends, a.out)
    print(a.out / "report.md")
    return report


if __name__ == "__main__":
    main()
