"""Tune the random baseline: sweep learning rates and the final decay per scale and optimizer, paired seeds.

    python -m bench.harness.tune --scale cpu-tiny --optimizer adamw --pool P --target T --val V --tokens 2048000 \
        --seeds 2 --grid model.lr=0.001,0.002,0.003,0.006 --then model.min_lr_ratio=0.1,0.0 \
        --threads 1 --jobs 2 --out bench/results/tune

Each point of the sweep is ``bench.harness.compare`` of ``random`` alone at the benchmark's token budget,
with the point's values as train.py flags (``--model.lr 0.002``) over the scale's own defaults (never
an earlier sweep's ``configs/tuned`` file), on the same seeds (same initialisation, same candidate
stream), so points differ only in their settings. ``--grid`` axes
are crossed; each ``--then`` axis is then swept alone from the best point so far. The best point
has the lowest mean final val bpb over the seeds. Writes ``<out>/<name>.md`` and ``.json`` (every point,
per-seed values) and ``configs/tuned/<name>.yaml`` (the best point's values), which ``bench.harness.compare``
adds to every run of that scale and optimizer. ``<name>`` is ``<scale>-<optimizer>``, or with ``--pool-name``
``<scale>-<optimizer>-<pool>-<horizon>`` (``cpu-mini-adamw-debian-32M``): settings tuned on one pool at one run
length, read by ``bench.harness.compare --pool-name`` at that length only. Finished runs are reused on re-run.
"""

from __future__ import annotations

import itertools
import json
from concurrent.futures import ProcessPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from jsonargparse import ArgumentParser

from bench.harness.compare import ROOT, compare, parse_seeds, scale_config, tuned_config, tuned_name
from bench.harness.compare import build_parser as compare_parser

Point = tuple[tuple[str, str], ...]


def parse_axis(text: str) -> tuple[str, list[str]]:
    """``"model.lr=0.001,0.002"`` → ``("model.lr", ["0.001", "0.002"])``; values holding commas are separated
    by ``;`` instead: ``"model.betas=[0.9,0.95];[0.9,0.99]"``."""
    key, sep, values = text.partition("=")
    if not sep or not key or not values:
        raise SystemExit(f"axis {text!r}: expected key=v1,v2,... (e.g. model.lr=0.001,0.003, or ; between list values)")
    return key, [v.strip() for v in values.split(";" if ";" in values else ",") if v.strip()]


def point_name(point: Point) -> str:
    return "@".join(f"{k.removeprefix('model.')}={v}" for k, v in point) or "defaults"


def split_jobs(jobs: int, seeds: int) -> tuple[int, int]:
    """``jobs`` runs at once as (points at once, seeds at once per point): seeds first, so a sweep of 3 points × 2
    seeds on 2 jobs trains each point's two seeds together instead of leaving the last point alone on one."""
    inner = max(1, min(jobs, seeds))
    return max(1, jobs // inner), inner


def run_point(a: Any, point: Point, seed_jobs: int = 1) -> dict[str, Any]:
    """``bench.harness.compare`` of random at this point, ``seed_jobs`` seeds at once; its per-seed final bpb."""
    out = Path(a.out) / tuned_name(scale_config(a.scale), a.optimizer, a.pool_name, a.tokens) / point_name(point)
    argv = ["--pool", a.pool, "--target", a.target, "--val", a.val, "--methods", "random", "--tokens", str(a.tokens),
            "--seeds", a.seeds, "--scale", a.scale, "--optimizer", a.optimizer, "--evals", str(a.evals),
            "--out", str(out), "--no-tuned", "--jobs", str(seed_jobs)]
    argv += ["--threads", str(a.threads)] if a.threads else []
    argv += ["--", *(x for k, v in point for x in (f"--{k}", v))]
    runs = compare(compare_parser().parse_args(argv))["methods"]["random"]["runs"]
    bpb = {r["seed"]: r["final_val_bpb"] for r in runs}
    return {"point": dict(point), "name": point_name(point), "bpb": bpb, "mean": float(np.mean(list(bpb.values()))),
            "folder": str(out)}


def sweep(a: Any, points: list[Point], done: dict[Point, dict]) -> None:
    """Run the points not yet done, ``a.jobs`` runs at a time (points in processes: each plots its own report)."""
    todo = [p for p in points if p not in done]
    point_jobs, seed_jobs = split_jobs(a.jobs, len(parse_seeds(a.seeds)))
    with ProcessPoolExecutor(max_workers=point_jobs) as pool:
        for point, row in zip(todo, pool.map(partial(run_point, a, seed_jobs=seed_jobs), todo)):
            done[point] = row


def table(rows: list[dict], best: dict, seeds: list[int]) -> str:
    lines = ["| point | " + " | ".join(f"seed {s}" for s in seeds) + " | mean | Δ vs best |",
             "|---|" + "---:|" * (len(seeds) + 2)]
    for r in sorted(rows, key=lambda r: r["mean"]):
        mark = " **(best)**" if r is best else ""
        lines.append(f"| `{r['name']}`{mark} | " + " | ".join(f"{r['bpb'][s]:.4f}" for s in seeds)
                     + f" | {r['mean']:.4f} | {r['mean'] - best['mean']:+.4f} |")
    return "\n".join(lines)


def write_tuned(path: Path, best: dict, report: Path) -> None:
    """The best point as a train.py config: nested YAML of its dotted keys, with where it came from."""
    nested: dict[str, Any] = {}
    for key, value in best["point"].items():
        *parents, leaf = key.split(".")
        node = nested
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = yaml.safe_load(value)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"# tuned by bench.harness.tune: {report.relative_to(ROOT) if report.is_relative_to(ROOT) else report}\n"
                    + yaml.safe_dump(nested, sort_keys=True))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = ArgumentParser(prog="python -m bench.harness.tune", description=__doc__.split("\n\n")[0])
    for flag in ("--pool", "--target", "--val"):
        p.add_argument(flag, required=True)
    p.add_argument("--scale", default="cpu-tiny")
    p.add_argument("--optimizer", choices=["adamw", "muon"], default="adamw")
    p.add_argument("--tokens", type=int, required=True, help="the benchmark's update-token budget per run")
    p.add_argument("--pool-name", default=None,
                   help="key the settings by pool and horizon: <scale>-<optimizer>-<pool name>-<horizon> (e.g. "
                        "cpu-mini-adamw-debian-32M), which bench.harness.compare --pool-name reads")
    p.add_argument("--seeds", default="2", help="a count (0..S-1) or a comma list; ≥ 2 for a sweep worth reading")
    p.add_argument("--grid", action="append", default=[], help="key=v1,v2,...: crossed with the other --grid axes")
    p.add_argument("--then", action="append", default=[], help="key=v1,v2,...: swept alone from the best point so far")
    p.add_argument("--evals", type=int, default=5, help="validation points per run")
    p.add_argument("--threads", type=int, default=None, help="CPU threads per run")
    p.add_argument("--jobs", type=int, default=1, help="runs at once, a point's seeds together first")
    p.add_argument("--out", default="bench/results/tune")
    p.add_argument("--write-config", type=bool, default=True, help="write configs/tuned/<name>.yaml")
    a = p.parse_args(argv)
    grid = [parse_axis(t) for t in a.grid]
    done: dict[Point, dict] = {}
    sweep(a, [tuple(zip([k for k, _ in grid], combo)) for combo in itertools.product(*[v for _, v in grid])], done)
    for key, values in (parse_axis(t) for t in a.then):
        base = min(done.values(), key=lambda r: r["mean"])["point"]
        sweep(a, [tuple({**base, key: v}.items()) for v in values], done)
    rows = list(done.values())
    best = min(rows, key=lambda r: r["mean"])
    seeds = sorted(best["bpb"])
    name = tuned_name(scale_config(a.scale), a.optimizer, a.pool_name, a.tokens)
    report = Path(a.out) / f"{name}.md"
    report.parent.mkdir(parents=True, exist_ok=True)
    text = (f"# Random-baseline sweep: {name}\n\n{a.tokens:,} update tokens per run, seeds {seeds} (paired), "
            f"final val bpb; grid {a.grid}, then {a.then}.\n\n{table(rows, best, seeds)}\n")
    report.write_text(text)
    (Path(a.out) / f"{name}.json").write_text(json.dumps({"rows": rows, "best": best, "argv": argv}, indent=1))
    if a.write_config:
        write_tuned(tuned_config(scale_config(a.scale), a.optimizer, a.pool_name, a.tokens), best, report.resolve())
    print(text, flush=True)
    return {"rows": rows, "best": best}


if __name__ == "__main__":
    main()
