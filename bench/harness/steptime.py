"""Per-step training time of methods relative to random, measured in one interleaved run.

    python -m bench.harness.steptime --pool P --target T --val V --methods random,opus,opus@sketch_dim=128 \
        --steps 120 --repeats 3 --optimizer muon --threads 1 --out bench/results/steptime/cpu-tiny-muon

Each (repeat, method) is a short ``train.py`` run (the comparison's command); repeats rotate the
method order so drifting machine load hits every method alike. A run's step time is the slope of
its training wall-clock (validation excluded) between its first and last validation, so fixed
costs (start-up, a reference pretrained at the start) drop out; they are reported separately as
the intercept. Ratios to random are taken within a repeat, then the median over repeats; a method run on
another training stack (``opus@model.compile=true``) is timed against random on that stack
(``random@model.compile=true``), which must be listed too. A compiled learner's runs also report how many
Dynamo graphs were added between the first and last validation (0 in a steady state: no recompilation).
On a host whose speed drifts between runs, the ratio of two runs drifts with it; the ``in-run ×`` column
does not: from each run's own selection seconds over the same validation points (``selection_curve``),
a step splits into its training part and its selection part at the same moments, and the ratio is
step / (step − selection + random's selection), random's training step standing in for the same work
(cache effects of the scoring on the training part are counted as training, so it can read slightly low).
Beside each measured ratio stands the method's modelled one (:mod:`bench.harness.cost_model`: the extra
forward and backward tokens its selector counted, weighed by each model's FLOPs per token, over
the training step's own) and the gap between the two: what the passes do not explain (maps,
sketches, host syncs, launches, Python). Writes ``steptime.json`` and ``steptime.md`` into ``--out``; the
table ends with the machine every run recorded (its processor, and the CPUs other processes held), since
ratios of the same code move with the host.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from jsonargparse import ArgumentParser

from bench.harness.compare import TRAIN_KEYS, Plan, prepare_online, resolve_variants
from bench.harness.compare import build_parser as compare_parser
from bench.harness.cost_model import modelled_cost
from bench.harness.train_child import ROOT, thread_env
from selection_callbacks.core.machine_load import ALONE_BELOW


def measure(run_dir: Path, eval_every: int) -> dict[str, float]:
    """Slope (seconds per step) and intercept of training wall-clock over the validation points."""
    m = json.loads((run_dir / "metrics.json").read_text())
    walls = [w for _, w, _ in m["curve"]]
    if len(walls) < 2:
        raise SystemExit(f"{run_dir}: fewer than two validation points; raise --steps or --evals")
    steps = (len(walls) - 1) * eval_every
    per_step = (walls[-1] - walls[0]) / steps
    selected = dict(m.get("selection_curve", []))  # update tokens → the selection's cumulative seconds
    first, last = m["curve"][0][0], m["curve"][-1][0]
    selection = (selected[last] - selected[first]) / steps if first in selected and last in selected else None
    sel, machine = m.get("selection") or {}, m.get("machine") or {}
    graphs = dict(m.get("dynamo_graphs", []))  # update tokens → Dynamo's graphs so far (a compiled learner's run)
    model = modelled_cost(m)
    return {
        "modelled_ratio": model["ratio"],
        "modelled_parts": model["parts"],
        "one_off_steps": model["one_off"],
        "step_seconds": per_step,
        "selection_step_seconds": selection,
        "fixed_seconds": walls[0] - per_step * eval_every,
        "wall_seconds": m["wall_seconds"],
        "selection_fraction": float(sel.get("overhead_seconds", 0.0)) / m["wall_seconds"] if m["wall_seconds"] else 0.0,
        "cpu": machine.get("cpu"),
        "other_cpus": machine.get("other_cpus"),
        "graphs_added": graphs[last] - graphs[first] if first in graphs and last in graphs else None,
    }


def rerun(config: Path, steps: int, every: int) -> dict[str, Any]:
    """:func:`measure` of ``config``'s ``train.py`` fit re-run in this process for ``steps`` steps, validating every
    ``every``, in a scratch folder (the calibration's plain step, a study's timed re-run)."""
    import train

    with tempfile.TemporaryDirectory() as tmp:
        train.main(["fit", "--config", str(config), "--trainer.max_steps", str(steps),
                    "--trainer.val_check_interval", str(every), "--trainer.default_root_dir", tmp])
        return measure(Path(tmp), every)


def baselines(names: list[str], overrides: dict[str, list[tuple[str, str]]]) -> dict[str, str]:
    """Each method's baseline: the random run on the same training stack (its ``model.``/``trainer.``/``data.``
    overrides), so ``opus@model.compile=true`` is timed against ``random@model.compile=true``.

    Raises:
        SystemExit: a method's stack has no random run among ``names``.
    """
    out = {}
    for name in names:
        stack = "".join(f"@{k}={v}" for k, v in overrides[name] if k.startswith(TRAIN_KEYS))
        out[name] = f"random{stack}"
        if out[name] not in overrides:
            raise SystemExit(f"{name} trains with {stack[1:]}: add {out[name]} to --methods, its baseline")
    return out


def in_run_ratio(run: dict[str, Any], random: dict[str, Any]) -> float | None:
    """step / (step − its selection + random's selection), each per step over the slope's validation points
    (None where a run recorded no selection curve)."""
    own, base = run.get("selection_step_seconds"), random.get("selection_step_seconds")
    if own is None or base is None:
        return None
    return run["step_seconds"] / (run["step_seconds"] - (own - base))  # random against itself: exactly 1


def summarise(runs: list[dict[str, Any]], base: list[dict[str, Any]], baseline: str) -> dict[str, Any]:
    """One method's repeats against its baseline's (same repeats): medians, per-repeat ratios, the model's ratio."""
    graphs = [x["graphs_added"] for x in runs if x.get("graphs_added") is not None]
    ratios = [x["step_seconds"] / b["step_seconds"] for x, b in zip(runs, base)]
    in_run = [in_run_ratio(x, b) for x, b in zip(runs, base)]
    return {
        "step_ms_median": 1e3 * statistics.median(x["step_seconds"] for x in runs),
        "ratio_to_random_median": statistics.median(ratios),
        "ratios": ratios,
        "in_run_ratio_median": None if None in in_run else statistics.median(in_run),
        "in_run_ratios": in_run,
        "modelled_ratio": runs[0]["modelled_ratio"],
        "modelled_parts": runs[0]["modelled_parts"],
        "one_off_steps": runs[0]["one_off_steps"],
        "fixed_seconds_median": statistics.median(x["fixed_seconds"] for x in runs),
        "selection_fraction_median": statistics.median(x["selection_fraction"] for x in runs),
        "baseline": baseline,
        "graphs_added_max": max(graphs) if graphs else None,
        "runs": runs,
    }


def machine_line(rows: dict[str, list[dict[str, Any]]]) -> str:
    """One sentence: the processors the runs recorded and the most CPUs other processes held during any of them."""
    runs = [r for method_runs in rows.values() for r in method_runs]
    cpus = sorted({r.get("cpu") or "not recorded" for r in runs})
    others = [r["other_cpus"] for r in runs if r.get("other_cpus") is not None]
    load = ("not recorded" if not others else
            f"other processes held at most {max(others):.2f} CPUs during a run"
            + (" (every run trained alone)" if max(others) < ALONE_BELOW else f" ({sum(x >= ALONE_BELOW for x in others)} of "
               f"{len(runs)} runs beside other work)"))
    return f"Machine: {'; '.join(cpus)}; {load}."


def add_run_arguments(p: ArgumentParser) -> None:
    """The data and method flags of a harness that times ``train.py`` runs of several methods."""
    p.add_argument("--pool", required=True, help="the training pool, passed to every run as --data.pool")
    p.add_argument("--target", required=True, help="the target split (what selectors may read)")
    p.add_argument("--val", required=True, help="the validation split (the runs' evaluation points)")
    p.add_argument("--methods", required=True, help="comma-separated, random included; name@arg=value variants")


def build_parser() -> ArgumentParser:
    """The ``bench.harness.steptime`` flags."""
    p = ArgumentParser(prog="python -m bench.harness.steptime", description=__doc__.split("\n\n")[0])
    add_run_arguments(p)
    p.add_argument("--steps", type=int, default=120, help="training steps per run")
    p.add_argument("--evals", type=int, default=4, help="validation points per run (the slope's support)")
    p.add_argument("--repeats", type=int, default=3, help="interleaved repeats, each running every method once")
    p.add_argument("--ratio", type=float, default=0.5, help="kept fraction K/N")
    p.add_argument("--optimizer", choices=["adamw", "muon"], default="adamw",
                   help="the learner's optimizer in every run")
    p.add_argument("--scale", default="cpu-tiny", help="configs/scale/<name>.yaml or a YAML path")
    p.add_argument("--threads", type=int, default=1, help="CPU threads per run")
    p.add_argument("--out", required=True, help="folder of the runs, steptime.json and steptime.md")
    return p


def main(argv: list[str] | None = None) -> dict[str, Any]:
    a = build_parser().parse_args(argv)
    names = [s.strip() for s in a.methods.split(",") if s.strip()]
    methods, overrides = resolve_variants(names)
    base_of = baselines(names, overrides)
    if any(m.offline for m in methods):
        raise SystemExit("step time is for online methods; an offline selector trains like random")
    probe = compare_parser().parse_args(["--pool", a.pool, "--target", a.target, "--val", a.val, "--tokens", "1",
                                         "--scale", a.scale, "--out", a.out, "--allow-untuned"])
    tokens = a.steps * Plan(probe).tokens_per_step
    args = compare_parser().parse_args([
        "--pool", a.pool, "--target", a.target, "--val", a.val, "--tokens", str(tokens), "--ratio", str(a.ratio),
        "--optimizer", a.optimizer, "--scale", a.scale, "--evals", str(a.evals), "--threads", str(a.threads),
        "--out", a.out, "--allow-untuned", "--", "--data.val_samples", "16",
    ])
    plan = Plan(args)
    plan.overrides = overrides
    env = thread_env(a.threads)
    rows: dict[str, list[dict[str, float]]] = {m.name: [] for m in methods}
    for r in range(a.repeats):
        order = methods[r % len(methods):] + methods[: r % len(methods)]
        for method in order:
            run_dir = plan.run_dir(method, r)
            run_dir.mkdir(parents=True, exist_ok=True)
            prepared = prepare_online(plan, method, r)[0] if method.prepare else []  # its one-off cost is not step time
            with open(run_dir / "train.log", "w") as log:
                proc = subprocess.run(plan.train_command(method, r, None, prepared), cwd=ROOT, stdout=log,
                                      stderr=subprocess.STDOUT, env=env)
            if proc.returncode != 0:
                raise SystemExit(f"[steptime] {method.name} repeat {r} failed; see {run_dir / 'train.log'}")
            rows[method.name].append(measure(run_dir, plan.eval_every))
            print(f"[steptime] repeat {r} {method.name}: {rows[method.name][-1]['step_seconds'] * 1e3:.1f} ms/step",
                  flush=True)
    summary = {name: summarise(runs, rows[base_of[name]], base_of[name]) for name, runs in rows.items()}
    out = Path(a.out)
    result = {"config": {**vars(a), "eval_every": plan.eval_every, "tokens_per_step": plan.tokens_per_step},
              "methods": summary}
    (out / "steptime.json").write_text(json.dumps(result, indent=1))
    lines = [f"# Step time vs random ({a.scale}, {a.optimizer}, ratio {a.ratio}, {a.threads} thread(s), "
             f"{a.steps} steps × {a.repeats} interleaved repeats)", "",
             f"`{' '.join(['python -m bench.harness.steptime', *(argv if argv is not None else sys.argv[1:])])}`", "",
             "| method | ms / step | × random (median of per-repeat ratios) | per-repeat | in-run × (per repeat) | modelled × | "
             "measured − modelled | in-run − modelled | modelled parts | one-off (plain steps) | fixed s | selection share |",
             "|---|---:|---:|---|---|---:|---:|---:|---|---:|---:|---:|"]
    for name, s in summary.items():
        parts = ", ".join(f"{k} {v:.2f}" for k, v in s["modelled_parts"].items()) or "none"
        in_run, modelled = s["in_run_ratio_median"], s["modelled_ratio"]
        in_run_cells = ("–", "–") if in_run is None else (
            f"{in_run:.2f} ({', '.join(f'{x:.2f}' for x in s['in_run_ratios'])})", f"{in_run - modelled:+.2f}")
        lines.append(f"| {name} | {s['step_ms_median']:.1f} | {s['ratio_to_random_median']:.2f} | "
                     f"{', '.join(f'{x:.2f}' for x in s['ratios'])} | {in_run_cells[0]} | {modelled:.2f} | "
                     f"{s['ratio_to_random_median'] - modelled:+.2f} | {in_run_cells[1]} | {parts} | {s['one_off_steps']:.0f} | "
                     f"{s['fixed_seconds_median']:.1f} | {s['selection_fraction_median']:.0%} |")
    graphs = {name: s["graphs_added_max"] for name, s in summary.items() if s["graphs_added_max"] is not None}
    if graphs:
        lines += ["", "Dynamo graphs added between the first and last validation (most over the repeats): "
                  + ", ".join(f"{name} {n}" for name, n in graphs.items()) + "."]
    stacks = {name: s["baseline"] for name, s in summary.items() if s["baseline"] != "random"}
    if stacks:
        lines += ["", "Baselines on another stack: " + ", ".join(f"{n} against {b}" for n, b in stacks.items()) + "."]
    lines += ["", machine_line(rows)]
    (out / "steptime.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return result


if __name__ == "__main__":
    main()
