"""Methods against random at an equal wall-clock budget, each run's length set from its own measured step time.

    python -m bench.harness.race --pool P --target T --val V --scale cpu-tiny \
        --methods random,rho@score_len=16 --budget 120 --threads 1 --out DIR

Every method gets the same budget B seconds of wall-clock for its whole run: the ``train.py`` process from
launch to exit (imports, data, model, a reference pretrained when training starts, the steps, validation) and
its prepare stage where it has one (``rho_lookup``'s loss table). Each run is the comparison's command
(:class:`bench.harness.compare.Plan`, the scale's tuned config where one exists, ``name@arg=value`` variants).

1. Probe: a ``--probe-steps`` P run of the method just before its race, validating at P/2 and P. Its step time
   s is the slope of its training wall-clock between the two validations (:func:`bench.harness.steptime.measure`);
   everything else it took is its overhead O = T − s·P (T: the probe's wall-clock), split for the table into the
   one-off (the prepare stage plus the training clock's intercept, e.g. RHO-LOSS's reference) and the start-up
   and validation (the process outside its training clock: imports, data, the two validations, exit).
2. Step budget: M = floor((B − O) / s), rounded down to an even number so that the race validates at M/2 and M,
   the probe's two validations, and O carries over unchanged. ``trainer.max_steps`` = M, so the warmup-cosine
   schedule (``selection_callbacks.nn.optim.warmup_cosine``) reaches its floor at the last step; the warmup is the
   configured one (scale or tuned config) capped at ``WARMUP_SHARE``·M.
3. Race: the M-step run; its wall-clock used, overrun (used − B; over ``--slack``·B the race exits non-zero
   once its files are written), val bpb at the budget (the final validation), steps and update tokens.

Before the first probe the token cache is filled and ``train.py`` imported once, so no run pays either. Runs go
one after another, so a change in the machine's load between a probe and its race moves the race's step time
and overrun (both in the table); the table ends with the machine line
(:func:`bench.harness.steptime.machine_line`). Writes ``race.json`` and ``race.md`` into ``--out`` (its
``probe/`` and ``race/`` run folders are cleared first: every run is timed afresh).
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml
from jsonargparse import ArgumentParser

from bench.harness.compare import Plan, resolve_variants, run_one, scale_config
from bench.harness.compare import build_parser as compare_parser
from bench.harness.methods import Method
from bench.harness.steptime import add_run_arguments, machine_line, measure
from bench.harness.train_child import ROOT
from selection_callbacks.data.datamodule import PoolDataModule

WARMUP_SHARE = 0.2
"""Largest warmup as a share of the run: the tuned baselines' own (200 warmup steps of cpu-tiny's 1,000-step sweep)."""


def step_budget(budget: float, overhead: float, step_seconds: float) -> int:
    """M = floor((budget − overhead) / step_seconds), rounded down to even (validations at M/2 and M).

    Example: ``step_budget(120, 30, 0.2)`` → 450; ``step_budget(120, 30.1, 0.2)`` → 448.
    """
    steps = math.floor((budget - overhead) / step_seconds) // 2 * 2
    if steps < 2:
        raise SystemExit(f"a {budget:g} s budget leaves no steps after {overhead:.1f} s of overhead at "
                         f"{step_seconds * 1e3:.1f} ms a step; raise --budget")
    return steps


def capped_warmup(steps: int, configured: int) -> int:
    """The configured warmup, at most ``WARMUP_SHARE``·steps (a short run still spends most of it decaying).

    Example: ``capped_warmup(450, 200)`` → 90; ``capped_warmup(2000, 200)`` → 200.
    """
    return min(configured, math.floor(WARMUP_SHARE * steps))


def plan_for(a: Any, folder: Path, steps: int, overrides: dict[str, list[tuple[str, str]]],
             extra: tuple[str, ...] = ()) -> Plan:
    """The comparison's plan of ``steps`` steps validating at steps/2 and steps, runs under ``folder``."""
    tokens_per_step = Plan(compare_parser().parse_args(_compare_argv(a, folder, 1))).tokens_per_step
    plan = Plan(compare_parser().parse_args(_compare_argv(a, folder, steps * tokens_per_step, extra)))
    plan.overrides = overrides
    return plan


def _compare_argv(a: Any, folder: Path, tokens: int, extra: tuple[str, ...] = ()) -> list[str]:
    return ["--pool", a.pool, "--target", a.target, "--val", a.val, "--tokens", str(tokens), "--ratio", str(a.ratio),
            "--optimizer", a.optimizer, "--scale", a.scale, "--evals", "2", "--threads", str(a.threads),
            "--seeds", str(a.seed), "--out", str(folder), "--allow-untuned", *(["--", *extra] if extra else [])]


def timed_run(plan: Plan, method: Method, seed: int) -> tuple[dict[str, Any], float]:
    """:func:`bench.harness.compare.run_one` and its wall-clock seconds (prepare stage and process together)."""
    start = time.perf_counter()
    record = run_one(plan, method, seed)
    return record, time.perf_counter() - start


def probe(plan: Plan, method: Method, seed: int) -> dict[str, Any]:
    """Step time, overhead and its split, and the configured warmup of a ``plan.steps``-step run."""
    record, seconds = timed_run(plan, method, seed)
    run_dir = plan.run_dir(method, seed)
    timing = measure(run_dir, plan.eval_every)
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    overhead = seconds - timing["step_seconds"] * plan.steps
    one_off = record["one_off_seconds"] + timing["fixed_seconds"]
    return {"steps": plan.steps, "wall_seconds": seconds, "step_seconds": timing["step_seconds"],
            "overhead_seconds": overhead, "one_off_seconds": one_off, "startup_validation_seconds": overhead - one_off,
            "configured_warmup": int(config["model"]["init_args"]["warmup_steps"]),
            "cpu": timing["cpu"], "other_cpus": timing["other_cpus"]}


def race(plan: Plan, method: Method, seed: int, budget: float, slack: float) -> dict[str, Any]:
    """The budgeted run: wall-clock used and overrun, val bpb, steps, update tokens, its own step time."""
    record, seconds = timed_run(plan, method, seed)
    timing = measure(plan.run_dir(method, seed), plan.eval_every)
    return {"max_steps": plan.steps, "global_step": record["global_step"], "update_tokens": record["update_tokens"],
            "wall_seconds": seconds, "overrun_seconds": seconds - budget,
            "within_slack": seconds <= budget * (1 + slack),
            "val_bpb": record["final_val_bpb"], "step_seconds": timing["step_seconds"],
            "cpu": timing["cpu"], "other_cpus": timing["other_cpus"]}


def warm_up(a: Any) -> None:
    """Tokenize and cache the three splits as the scale's runs read them, and import ``train.py`` once in a process
    of its own (bytecode written, libraries read from disk): the first probe then starts as warm as the others."""
    scale = yaml.safe_load(scale_config(a.scale).read_text())
    PoolDataModule(**{**scale.get("data", {}), "pool": a.pool, "target": a.target, "val": a.val,
                      "progress": False}).prepare_data()
    subprocess.run([sys.executable, "-c", "import train"], cwd=ROOT, check=True)


def markdown(result: dict[str, Any], argv: list[str]) -> str:
    """race.md: the command, one row per method, the machine line."""
    c, methods = result["config"], result["methods"]
    base = methods["random"]["race"]["val_bpb"]
    lines = [f"# Equal wall-clock race ({c['scale']}, {c['optimizer']}, ratio {c['ratio']}, {c['budget']:g} s each, "
             f"seed {c['seed']}, {c['threads']} thread(s))", "",
             f"`{' '.join(['python -m bench.harness.race', *argv])}`", "",
             f"Tuned config: {c['tuned'] or 'none (the scale config alone)'}. Probe: {c['probe_steps']} steps. "
             f"Warmup: the configured one, at most {WARMUP_SHARE:.0%} of max_steps. "
             f"Slack: {c['slack']:.0%} of the budget. Δ: val bpb minus random's (negative is better).", "",
             "| method | ms / step (probe) | ms / step (race) | one-off s | start-up & validation s | max_steps | "
             "warmup | update tokens | wall-clock used / budget | overrun s | val bpb at the budget | Δ vs random |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, m in methods.items():
        p, r = m["probe"], m["race"]
        over = "" if r["within_slack"] else " **over the slack**"
        lines.append(f"| {name} | {p['step_seconds'] * 1e3:.1f} | {r['step_seconds'] * 1e3:.1f} | "
                     f"{p['one_off_seconds']:.1f} | {p['startup_validation_seconds']:.1f} | {r['max_steps']} | "
                     f"{m['warmup_steps']} | {r['update_tokens']:,} | {r['wall_seconds']:.1f} / {c['budget']:g} | "
                     f"{r['overrun_seconds']:+.1f}{over} | {r['val_bpb']:.4f} | {r['val_bpb'] - base:+.4f} |")
    return "\n".join(lines + ["", result["machine"]]) + "\n"


def build_parser() -> ArgumentParser:
    """The ``bench.harness.race`` flags."""
    p = ArgumentParser(prog="python -m bench.harness.race", description=__doc__.split("\n\n")[0])
    add_run_arguments(p)
    p.add_argument("--budget", type=float, required=True, help="wall-clock seconds per method's run")
    p.add_argument("--scale", default="cpu-tiny", help="configs/scale/<name>.yaml or a YAML path")
    p.add_argument("--optimizer", choices=["adamw", "muon"], default="adamw", help="the learner's optimizer")
    p.add_argument("--ratio", type=float, default=0.5, help="kept fraction K/N")
    p.add_argument("--seed", type=int, default=0, help="the paired seed: every method's initialisation and candidates")
    p.add_argument("--probe-steps", type=int, default=20, help="steps of each method's probe (even, ≥ 2)")
    p.add_argument("--slack", type=float, default=0.1, help="allowed overrun as a share of the budget")
    p.add_argument("--threads", type=int, default=1, help="CPU threads per run")
    p.add_argument("--out", required=True, help="folder of the runs, race.json and race.md")
    return p


def main(argv: list[str] | None = None) -> dict[str, Any]:
    argv = sys.argv[1:] if argv is None else argv
    a = build_parser().parse_args(argv)
    if a.probe_steps < 2 or a.probe_steps % 2:
        raise SystemExit("--probe-steps must be even and ≥ 2 (validations at half and end)")
    methods, overrides = resolve_variants([s.strip() for s in a.methods.split(",") if s.strip()])
    out = Path(a.out)
    for folder in ("probe", "race"):
        shutil.rmtree(out / folder, ignore_errors=True)
    warm_up(a)
    entries: dict[str, Any] = {}
    for m in methods:  # each probe just before its race: the machine's load has the least time to move between them
        p = probe(plan_for(a, out / "probe", a.probe_steps, overrides), m, a.seed)
        steps = step_budget(a.budget, p["overhead_seconds"], p["step_seconds"])
        warmup = capped_warmup(steps, p["configured_warmup"])
        print(f"[race] {m.name}: {p['step_seconds'] * 1e3:.1f} ms/step, {p['overhead_seconds']:.1f} s overhead → "
              f"{steps} steps, warmup {warmup}", flush=True)
        plan = plan_for(a, out / "race", steps, overrides, ("--model.warmup_steps", str(warmup)))
        entries[m.name] = {"warmup_steps": warmup, "probe": p, "race": race(plan, m, a.seed, a.budget, a.slack)}
    tuned = plan.tuned
    result = {"config": {**vars(a), "tuned": str(tuned.relative_to(ROOT)) if tuned else None,
                         "tokens_per_step": plan.tokens_per_step, "warmup_share": WARMUP_SHARE},
              "methods": entries,
              "machine": machine_line({n: [e["probe"], e["race"]] for n, e in entries.items()})}
    (out / "race.json").write_text(json.dumps(result, indent=1))
    text = markdown(result, argv)
    (out / "race.md").write_text(text)
    print(text, end="")
    over = [n for n, e in entries.items() if not e["race"]["within_slack"]]
    if over:
        raise SystemExit(f"[race] over the budget by more than {a.slack:.0%}: {', '.join(over)} "
                         f"(see {out / 'race.md'})")
    return result


if __name__ == "__main__":
    main()
