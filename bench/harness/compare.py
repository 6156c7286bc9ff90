"""Every method side by side on one pool, model, optimizer, schedule and update-token budget.

    python -m bench.harness.compare --pool P --target T --val V --methods random,high_loss,oracle \
        --tokens 2000000 --seeds 3 --ratio 0.5 --scale cpu-tiny --out bench/results/NAME

Paired design: seed s gives every method the same initialisation (``seed_everything``) and the
same stream of candidate superbatches (``data.seed``). Each (method, seed) run is a ``train.py``
subprocess (``--jobs`` of them at once); its ``metrics.json`` holds val bpb at fixed update-token intervals with
training wall-clock. Finished runs are skipped on re-run: from their run folder, or, where that is gone (a fresh
clone), from their record in the ``results.json`` they were written to. ``results.json`` (every run's record: its
curve and what its metrics.json holds) is rewritten as each run finishes, so a comparison committed part-way resumes
where it stopped; a re-run listing fewer methods or seeds keeps the other records, and a results.json of another
config is refused, not overwritten. ``report.md`` and plots follow at the end (``python -m bench.harness.report``
redraws them from results.json alone; a committed comparison keeps results.json, report.md and a README, not the runs
or plots).

A method name may carry selection-argument overrides for sweeps, ``name@arg=value[@arg=value]``:
``opus@temperature=0.5`` runs ``opus`` with ``--selection.init_args.temperature 0.5`` (and is
reported under that name). For an offline method the overrides set its selector's config, dotted
into nested settings: ``datamask@bank.proxy_tokens=null`` selects with a full-pass feature bank. An
online method's override of a ``model.``, ``trainer.`` or ``data.`` key goes to train.py as it is:
``opus@model.compile=true`` runs OPUS on a compiled learner (``--model.compile true``).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import subprocess
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Any

import yaml
from jsonargparse import ArgumentParser

from bench.harness.cost_model import modelled_cost
from bench.harness.methods import Method, resolve
from bench.harness.report import write_report
from bench.harness.train_child import ROOT, fit_command, thread_env

TRAIN_KEYS = ("model.", "trainer.", "data.")  # variant keys that are train.py flags, not selection arguments
RENAMED_ARGS = {"proxy_batch_size": "target_batch_size", "stack_layers": "group_layers"}  # names in committed keys


def split_variant(name: str) -> tuple[str, list[tuple[str, str]]]:
    """``"opus@temperature=0.5"`` → ``("opus", [("temperature", "0.5")])``."""
    base, *parts = name.split("@")
    overrides = []
    for part in parts:
        key, sep, value = part.partition("=")
        if not sep or not key or not value:
            raise SystemExit(f"method variant {name!r}: expected name@arg=value[@arg=value]")
        overrides.append((key, value))
    return base, overrides


def resolve_variants(names: list[str]) -> tuple[list[Method], dict[str, list[tuple[str, str]]]]:
    """Registry methods (variants renamed) and each variant's selection overrides."""
    bases = resolve([split_variant(n)[0] for n in names])
    methods, overrides = [], {}
    for name, base in zip(names, bases):
        _, extra = split_variant(name)
        methods.append(dataclasses.replace(base, name=name))
        overrides[name] = extra
    return methods, overrides


def parse_seeds(text: str) -> list[int]:
    """``"3"`` → [0, 1, 2]; ``"0,4,7"`` → [0, 4, 7]."""
    if "," in text:
        return [int(s) for s in text.split(",") if s.strip()]
    n = int(text)
    if n < 1:
        raise SystemExit("--seeds must be ≥ 1")
    return list(range(n))


def scale_config(scale: str) -> Path:
    path = Path(scale) if scale.endswith(".yaml") else ROOT / "configs" / "scale" / f"{scale}.yaml"
    if not path.exists():
        known = sorted(p.stem for p in (ROOT / "configs" / "scale").glob("*.yaml"))
        raise SystemExit(f"scale {scale!r} not found; known scales: {', '.join(known)}")
    return path


def horizon_label(tokens: int) -> str:
    """A run length as the tuned settings name it: whole millions of update tokens (``32768000`` → ``"32M"``),
    thousands below a million."""
    return f"{tokens // 1_000_000}M" if tokens >= 1_000_000 else f"{tokens // 1_000}k"


def tuned_name(scale_path: Path, optimizer: str, pool_name: str | None = None, tokens: int | None = None) -> str:
    """``<scale>-<optimizer>``, or ``<scale>-<optimizer>-<pool>-<horizon>`` for settings tuned on one pool at one
    run length (:func:`horizon_label`)."""
    name = f"{scale_path.stem}-{optimizer}"
    return name if pool_name is None else f"{name}-{pool_name}-{horizon_label(tokens or 0)}"


def tuned_config(scale_path: Path, optimizer: str, pool_name: str | None = None, tokens: int | None = None) -> Path:
    """``configs/tuned/<tuned_name>.yaml``: the tuned learning rates and decay ``bench.harness.tune`` wrote."""
    return ROOT / "configs" / "tuned" / f"{tuned_name(scale_path, optimizer, pool_name, tokens)}.yaml"


def file_digest(path: str) -> str:
    """sha256 of a file, or of a folder's file names, sizes and contents."""
    p = Path(path)
    files = [p] if p.is_file() else sorted(f for f in p.rglob("*") if f.is_file())
    h = hashlib.sha256()
    for f in files:
        h.update(str(f.relative_to(p) if p.is_dir() else f.name).encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True, text=True)
        return out.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


class Plan:
    """Run length and evaluation grid, derived once from the scale config and the token budget."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.scale_path = scale_config(args.scale)
        cfg = yaml.safe_load(self.scale_path.read_text())
        data, trainer = cfg.get("data", {}), cfg.get("trainer", {})
        self.batch_size = int(data.get("batch_size", 16))
        self.seq_len = int(data.get("seq_len", 128))
        accumulate = int(trainer.get("accumulate_grad_batches", 1))
        self.tokens_per_step = self.batch_size * self.seq_len * accumulate
        self.steps = max(1, args.tokens // self.tokens_per_step)
        self.eval_every = max(1, self.steps // args.evals)
        self.tuned = tuned_config(self.scale_path, args.optimizer, args.pool_name, args.tokens)
        if args.no_tuned:
            self.tuned = None
        elif not self.tuned.exists():
            if not args.allow_untuned:
                keyed = "" if args.pool_name is None else f" --pool-name {args.pool_name} --tokens {args.tokens}"
                raise SystemExit(
                    f"no tuned baseline for scale {self.scale_path.stem!r} under {args.optimizer}: {self.tuned} is "
                    f"missing. Sweep it with python -m bench.harness.tune --scale {self.scale_path.stem} --optimizer "
                    f"{args.optimizer}{keyed} ..., or pass --allow-untuned (the report then says the baseline is untuned)"
                )
            self.tuned = None
        self.args = args
        self.overrides: dict[str, list[tuple[str, str]]] = {}
        self.config = {
            "scale": self.scale_path.read_text(),
            "ratio": args.ratio,
            "tokens": args.tokens,
            "steps": self.steps,
            "eval_every_steps": self.eval_every,
            "optimizer": args.optimizer,
            "data": {k: file_digest(getattr(args, k)) for k in ("pool", "target", "val")},
            "extra": args.extra,
            "threads": args.threads,
            "tuned": self.tuned.read_text() if self.tuned else None,
        }
        # an untuned run hashes as runs made before tuned baselines existed (they were untuned too)
        hashed = {k: v for k, v in self.config.items() if not (k == "tuned" and v is None)}
        self.config_hash = hashlib.sha256(json.dumps(hashed, sort_keys=True).encode()).hexdigest()[:12]

    def run_dir(self, method: Method, seed: int) -> Path:
        return Path(self.args.out) / "runs" / self.config_hash / method.name / f"seed{seed}"

    def train_command(self, method: Method, seed: int, subset: Path | None, prepared: list[tuple[str, str]] = ()) -> list[str]:
        a = self.args
        configs = [self.scale_path, *([self.tuned] if self.tuned else []), method.config or "configs/method/random.yaml"]
        cmd = fit_command(configs, seed, a.pool, a.target, a.val, self.steps, self.eval_every, self.run_dir(method, seed))
        cmd += ["--data.ratio", "1.0" if subset else str(a.ratio), "--model.optimizer", a.optimizer]
        if subset:
            cmd += ["--data.subset", str(subset)]
        for key, value in [] if method.offline else [*self.overrides.get(method.name, []), *prepared]:
            key = RENAMED_ARGS.get(key, key)
            cmd += [f"--{key}" if key.startswith(TRAIN_KEYS) else f"--selection.init_args.{key}", value]
        return cmd + list(a.extra)


def finished(metrics_path: Path, steps: int) -> bool:
    if not metrics_path.exists():
        return False
    m = json.loads(metrics_path.read_text())
    return m.get("global_step", 0) >= steps and bool(m.get("curve")) and m["curve"][-1][0] == m["update_tokens"]


def cached_stage(plan: Plan, method: Method, seed: int, key: str, run: Callable[[Path], Any]) -> tuple[Any, float]:
    """``run(folder)`` once per (config, method, seed): its JSON-able result (``key`` in the file) and seconds, reused from
    ``prepare.json`` while the method's identity is unchanged (a file from before identities were recorded counts)."""
    folder = Path(plan.args.out) / "prepare" / plan.config_hash / method.name / f"seed{seed}"
    done = folder / "prepare.json"
    identity = method_identity(plan, method)
    if done.exists():
        info = json.loads(done.read_text())
        if info.get("identity", identity) == identity:
            return info[key], float(info["seconds"])
        print(f"[bench] {method.name} seed {seed}: its inputs changed since it was prepared; preparing again")
    folder.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    result = run(folder)
    seconds = time.perf_counter() - start
    done.write_text(json.dumps({key: result, "seconds": seconds, "identity": identity}))
    return result, seconds


def prepare_offline(plan: Plan, method: Method, seed: int) -> tuple[Path, float]:
    """Run an offline selector once per seed (cached); returns its subset file and selection seconds."""
    budget = plan.steps * plan.tokens_per_step  # tokens the run will train on
    overrides = plan.overrides.get(method.name, [])
    subset, seconds = cached_stage(plan, method, seed, "subset", lambda folder: str(method.select(
        plan.args.pool, plan.args.target, budget, seed, folder, *([overrides] if overrides else []))))
    return Path(subset), seconds


def prepare_online(plan: Plan, method: Method, seed: int) -> tuple[list[tuple[str, str]], float]:
    """Run an online method's prepare stage once per seed (cached); returns its selection overrides and seconds."""
    a = plan.args
    overrides, seconds = cached_stage(plan, method, seed, "overrides", lambda folder: method.prepare(
        a.pool, a.target, a.val, plan.scale_path, ROOT / method.config, seed, folder, a.threads,
        plan.overrides.get(method.name, [])))
    return [tuple(o) for o in overrides], seconds


def method_identity(plan: Plan, method: Method) -> str:
    """What a run of ``method`` trained with: its method config's text (an offline selector's inputs) and
    overrides (not in the config hash)."""
    overrides = "".join(f"override {k}={v}\n" for k, v in plan.overrides.get(method.name, []))
    if method.offline:
        inputs = "".join(f"{f}:\n{(ROOT / f).read_text()}" for f in method.inputs)
        settings = f"settings {method.settings(plan.overrides.get(method.name, []))}\n" if method.settings else ""
        return f"offline selector {method.name}\n" + inputs + settings + overrides
    return (ROOT / (method.config or "configs/method/random.yaml")).read_text() + overrides


def identity_digest(identity: str) -> str:
    return hashlib.sha256(identity.encode()).hexdigest()[:16]


def earlier_results(out: Path, config_hash: str) -> dict[str, Any]:
    """The ``results.json`` already in ``out`` (``{}`` if none); one of another config is refused, not overwritten."""
    path = out / "results.json"
    if not path.exists():
        return {}
    earlier = json.loads(path.read_text())
    if earlier.get("config_hash") != config_hash:
        runs = sum(len(entry["runs"]) for entry in earlier.get("methods", {}).values())
        raise SystemExit(
            f"[bench] {path} records {runs} runs of comparison config {earlier.get('config_hash')}, this one is "
            f"{config_hash} (another scale, pool, budget, tuned baseline or train.py flags): use another --out, or "
            "move that results.json aside to start this folder over"
        )
    return earlier


def recorded_runs(earlier: dict[str, Any]) -> dict[tuple[str, int], dict[str, Any]]:
    """The run records of an earlier ``results.json`` by (method, seed); only records that carry their method's
    identity digest (older ones are rerun)."""
    return {(name, r["seed"]): r for name, entry in earlier.get("methods", {}).items() for r in entry["runs"]
            if "identity" in r}


def kept_records(earlier: dict[str, Any], order: list[tuple[int, Method]]) -> dict[str, Any]:
    """An earlier ``results.json``'s methods, each with only the runs this comparison does not list: a re-run with
    fewer methods or seeds keeps what was recorded before."""
    listed = {(m.name, seed) for seed, m in order}
    kept = {name: {**entry, "runs": [r for r in entry["runs"] if (name, r["seed"]) not in listed]}
            for name, entry in earlier.get("methods", {}).items()}
    return {name: entry for name, entry in kept.items() if entry["runs"]}


def reused_record(plan: Plan, method: Method, seed: int, record: dict[str, Any]) -> dict[str, Any]:
    """A run recorded in results.json whose folder is gone: its record, if made with the method's current identity."""
    if record["identity"] != identity_digest(method_identity(plan, method)):
        raise SystemExit(
            f"[bench] {Path(plan.args.out) / 'results.json'} records a finished {method.name} seed {seed} run made with "
            "another method config: rerun it under a name@arg=value variant, or use a new --out"
        )
    print(f"[bench] {method.name} seed {seed}: finished (recorded in results.json), skipped", flush=True)
    return {k: v for k, v in record.items() if k != "step_time_ratio"}


def run_one(plan: Plan, method: Method, seed: int) -> dict[str, Any]:
    """Train (or reuse) one method-seed run and return its record for results.json.

    A finished run is reused only if its recorded ``method.txt`` matches the method's current
    config: a method config edited after its runs were made is an error, not a silent mix.
    """
    run_dir = plan.run_dir(method, seed)
    subset, selection_seconds = prepare_offline(plan, method, seed) if method.offline else (None, 0.0)
    prepared, one_off = prepare_online(plan, method, seed) if method.prepare else ([], 0.0)
    selection_seconds += one_off
    metrics_path = run_dir / "metrics.json"
    identity, recorded = method_identity(plan, method), run_dir / "method.txt"
    if finished(metrics_path, plan.steps):
        if recorded.exists() and recorded.read_text() != identity:
            raise SystemExit(
                f"[bench] {run_dir} holds a finished {method.name} run made with another method config "
                f"({recorded} differs from the current one): move it aside, e.g. under a name@arg=value variant, "
                "or use a new --out"
            )
        print(f"[bench] {method.name} seed {seed}: finished, skipped", flush=True)
    else:
        print(f"[bench] {method.name} seed {seed}: training {plan.steps} steps", flush=True)
        run_dir.mkdir(parents=True, exist_ok=True)
        recorded.write_text(identity)
        env = thread_env(plan.args.threads) if plan.args.threads else dict(os.environ)
        with open(run_dir / "train.log", "w") as log:
            proc = subprocess.run(
                plan.train_command(method, seed, subset, prepared), cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env
            )
        if proc.returncode != 0 or not finished(metrics_path, plan.steps):
            raise SystemExit(f"[bench] {method.name} seed {seed} failed (exit {proc.returncode}); see {run_dir / 'train.log'}")
    m = json.loads(metrics_path.read_text())
    sel = m.get("selection") or {}
    online_seconds = float(sel.get("overhead_seconds", 0.0))
    return {
        "seed": seed,
        "final_val_bpb": m["val_bpb"] if m["val_bpb"] is not None else m["val_loss"],
        "curve_metric": m.get("curve_metric", "val_bpb"),
        "curve": [[t, w + selection_seconds, b] for t, w, b in m["curve"]],
        "wall_seconds": m["wall_seconds"] + selection_seconds,
        "overhead_fraction": online_seconds / m["wall_seconds"] if m["wall_seconds"] else 0.0,
        "selection_seconds": online_seconds + selection_seconds,
        "one_off_seconds": one_off,
        "domains": sel.get("domains", {}),
        "domain_history": m.get("domain_history", []),
        "diagnostics": {k: v for k, v in (sel.get("diagnostics") or {}).items() if k != "history"},
        "modelled_step_ratio": modelled_step_ratio(m),
        "machine": m.get("machine"),
        "run_dir": str(run_dir.relative_to(Path(plan.args.out))),
        "identity": identity_digest(identity),
        **run_metrics(m),
    }


def run_metrics(m: dict[str, Any]) -> dict[str, Any]:
    """What a run's metrics.json holds beyond the record's other fields: results.json alone then carries every run
    (the run folders are not kept with a committed comparison)."""
    sel = m.get("selection") or {}
    return {
        "val_loss": m.get("val_loss"),
        "global_step": m.get("global_step"),
        "update_tokens": m.get("update_tokens"),
        "train_wall_seconds": m.get("wall_seconds"),  # training alone: wall_seconds less the offline selection
        "selection_counts": {k: sel[k] for k in ("method", "selections", "candidates_seen", "kept") if k in sel},
    }


def modelled_step_ratio(metrics: dict[str, Any]) -> float | None:
    """The run's modelled step ratio (:mod:`bench.harness.cost_model`); None for a run whose summary predates FLOPs per token."""
    try:
        return modelled_cost(metrics)["ratio"]
    except ValueError:
        return None


def dotted(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"model": {"lr": 0.003}}`` → ``{"model.lr": 0.003}``."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        flat.update(dotted(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}": value})
    return flat


def tuning_runs(plan: Plan, point: Path) -> dict[tuple[int, str], dict[str, Any]]:
    """Random's runs at the tuning sweep's best point (``--random-from``: a ``bench.harness.tune`` point folder), by
    (seed, "random"): the same runs this comparison would train, since the point's flags are the tuned config's values
    and every other setting (scale, budget, evaluation grid, data, threads) is this comparison's; anything else is
    refused."""
    earlier = json.loads((point / "results.json").read_text())
    extra = earlier["config"]["extra"]
    flags = {k.removeprefix("--"): yaml.safe_load(v) for k, v in zip(extra[::2], extra[1::2])}
    tuned = dotted(yaml.safe_load(plan.config["tuned"]) or {}) if plan.config["tuned"] else {}
    rest = [k for k in plan.config if k not in ("extra", "tuned") and earlier["config"].get(k) != plan.config[k]]
    if flags != tuned or rest or plan.config["extra"]:
        raise SystemExit(f"--random-from {point}: its runs are not this comparison's random (point {flags}, tuned "
                         f"{tuned}; other settings that differ: {rest or 'none'}; extra flags here: {plan.config['extra']})")
    return {(r["seed"], "random"): r for r in earlier["methods"]["random"]["runs"]}


def method_records(order: list[tuple[int, Method]], runs: dict[tuple[int, str], dict[str, Any]],
                   kept: dict[str, Any]) -> dict[str, Any]:
    """results.json's ``methods``: each method's finished runs and its ``kept`` ones from before, in seed order."""
    methods: dict[str, Any] = {}
    for seed, m in order:
        if (seed, m.name) in runs:
            methods.setdefault(m.name, {"offline": m.offline, "family": m.family, "runs": []})["runs"].append(runs[(seed, m.name)])
    for name, entry in kept.items():
        merged = methods.setdefault(name, {**entry, "runs": []})
        merged["runs"] = sorted(merged["runs"] + entry["runs"], key=lambda r: r["seed"])
    return methods


def compare(args: argparse.Namespace) -> dict[str, Any]:
    methods, overrides = resolve_variants([s.strip() for s in args.methods.split(",") if s.strip()])
    seeds = parse_seeds(args.seeds)
    plan = Plan(args)
    plan.overrides = overrides
    print(f"[bench] config {plan.config_hash}: {plan.steps} steps × {plan.tokens_per_step} update tokens, "
          f"eval every {plan.eval_every} steps, seeds {seeds}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    earlier = earlier_results(out, plan.config_hash)
    recorded = recorded_runs(earlier)
    results: dict[str, Any] = {"commit": git_commit(), "config_hash": plan.config_hash, "config": plan.config, "methods": {}}
    order = [(seed, method) for seed in seeds for method in methods]  # seed-major: a partial comparison is already paired
    kept = kept_records(earlier, order)
    runs = {(seed, m.name): reused_record(plan, m, seed, recorded[(m.name, seed)]) for seed, m in order
            if (m.name, seed) in recorded and not (plan.run_dir(m, seed) / "metrics.json").exists()}
    if args.random_from:
        wanted = {(seed, m.name) for seed, m in order}
        for key, run in tuning_runs(plan, Path(args.random_from)).items():
            if key in wanted and key not in runs:
                print(f"[bench] random seed {key[0]}: the sweep's run in {args.random_from}, reused", flush=True)
                runs[key] = {k: v for k, v in run.items() if k != "step_time_ratio"}
    todo = [(seed, m) for seed, m in order if (seed, m.name) not in runs]
    if args.jobs > 1:  # one-off stages run in this process, one at a time (cached), before the runs train at once
        for seed, m in todo:
            if m.offline:
                prepare_offline(plan, m, seed)
            elif m.prepare:
                prepare_online(plan, m, seed)
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        pending = {pool.submit(run_one, plan, m, seed): (seed, m.name) for seed, m in todo}
        for done in as_completed(pending):
            runs[pending[done]] = done.result()
            results["methods"] = method_records(order, runs, kept)
            (out / "results.json").write_text(json.dumps(results, indent=1))
    results["methods"] = method_records(order, runs, kept)
    for name, entry in results["methods"].items():
        base = {r["seed"]: r["wall_seconds"] for r in results["methods"]["random"]["runs"]}
        for r in entry["runs"]:
            if r["seed"] in base:
                r["step_time_ratio"] = r["wall_seconds"] / base[r["seed"]]
    (out / "results.json").write_text(json.dumps(results, indent=1))
    write_report(results, out)
    print(f"[bench] wrote {out / 'results.json'} and {out / 'report.md'}", flush=True)
    return results


def build_parser() -> ArgumentParser:
    """The ``bench.harness.compare`` flags (``bench.harness.steptime`` builds its train.py runs through them too)."""
    p = ArgumentParser(prog="python -m bench.harness.compare", description=__doc__.split("\n\n")[0])
    p.add_argument("--pool", required=True, help="the training pool, passed to every run as --data.pool")
    p.add_argument("--target", required=True, help="what selectors may read")
    p.add_argument("--val", required=True, help="evaluation only")
    p.add_argument("--methods", default="random,high_loss", help="comma-separated method names")
    p.add_argument("--tokens", type=int, required=True, help="update-token budget per run")
    p.add_argument("--seeds", default="3", help="a count (0..S-1) or a comma list")
    p.add_argument("--ratio", type=float, default=0.5, help="kept fraction K/N")
    p.add_argument("--optimizer", choices=["adamw", "muon"], default="adamw",
                   help="the learner's optimizer in every run")
    p.add_argument("--scale", default="cpu-tiny", help="configs/scale/<name>.yaml or a YAML path")
    p.add_argument("--evals", type=int, default=10, help="validation points per run")
    p.add_argument("--threads", type=int, default=None, help="CPU threads per run (part of the config)")
    p.add_argument("--jobs", type=int, default=1, help="runs trained at once, each a train.py process (set --threads so "
                   "jobs × threads fits the cores)")
    p.add_argument("--pool-name", default=None,
                   help="the pool's name: train against random tuned on it at this run's length, "
                        "configs/tuned/<scale>-<optimizer>-<pool name>-<horizon>.yaml (bench.harness.tune --pool-name); "
                        "without it, configs/tuned/<scale>-<optimizer>.yaml")
    p.add_argument("--allow-untuned", action="store_true",
                   help="run without configs/tuned/<scale>-<optimizer>.yaml (the report says the baseline is untuned)")
    p.add_argument("--no-tuned", action="store_true",
                   help="leave configs/tuned out even where it exists (bench.harness.tune's sweeps set every value themselves)")
    p.add_argument("--random-from", default=None, help="a bench.harness.tune point folder: random's runs are its "
                   "runs where their settings are this comparison's (the sweep's best point trained them already)")
    p.add_argument("--out", required=True, help="folder of the runs, results.json, report.md and the plots")
    p.add_argument("extra", nargs="*", default=[], help="extra train.py flags after --, e.g. -- --model.lr 0.002")
    return p


def main(argv: list[str] | None = None) -> dict[str, Any]:
    return compare(build_parser().parse_args(argv))


if __name__ == "__main__":
    main()
