"""Seconds per pass on this host: the per-model rates that calibrate the cost model's FLOP weights.

    python -m bench.harness.pass_timing bench/results/ladder/steptime-cpu-mini --threads 1

The FLOP model (:func:`bench.harness.cost_model.modelled_cost`) weighs every pass at the training step's
FLOP rate. A CPU runs models of different widths at different rates: a small model's matmuls are short and its
per-call overhead weighs more, so at cpu-mini (2 × 64) a learner FLOP costs more wall-clock than a FLOP of
its 2 × 128 proxies, and the FLOP model overstates the proxies' share. This module times each pass a steptime
run's selector counted, at that run's shapes, and the learner's plain step, in rounds: each round is a fresh
process that times them all. For a run whose selector counted ``passes_k`` passes of kind k over ``steps`` steps,

    calibrated ratio = 1 + Σ_k (passes_k / steps) · t_k / t_step

t_step: the plain step as the Trainer runs it: the random run of the same folder re-run through ``train.py``'s
entry point in the round's process for ``--run-steps`` steps, its training wall-clock's slope between its first
and last validation (the steptime run's own measure), so the data, hooks and logging every step pays are in it.
The learner's forward, cross-entropy backward and AdamW step over the K × T tokens it trains on, without the
Trainer, is timed beside it (``learner_step_seconds``); their quotient less one is the framework's share of the
plain step (``framework_share``), the part a FLOP count cannot see. t_k: seconds of one pass of kind k: a forward
without gradients over rows × length tokens with each row's mean token loss, as a scoring forward reads it
(length: the method's ``score_len`` when it scores windows, else the run's T; rows: the pass's tokens / length), a
backward the difference between a training pass (forward, backward, and an AdamW step for a proxy, which trains;
none for the learner's scoring backward) and that forward. Passes
under ``*_pretrain`` (one-off) are left out, as in the FLOP model. Not timed, so they show in the check as
measured − calibrated: the selection's non-pass work (top-K, gathers, the ghost methods' maps and sketches) and
cache effects between the selection and the training step.

On a shared host one process runs several percent faster or slower than the next, and the ratio of two shapes'
times within a process moves by a few percent too; a pass timed in one process and the plain step in another
carry both. So t_k and t_step of a round come from the same process (the plain step first in every other round),
and a method's calibrated ratio is the median over the rounds' ratios.

Writes ``pass_timing.json`` into the steptime folder: per method, the calibrated ratio of each round and their
median, and each kind's median seconds per step; the plain step's and the learner step's median seconds; and per
round the CPUs other processes held while it ran (``other_cpus``).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import yaml
from jsonargparse import SUPPRESS, ArgumentParser

from bench.harness.cost_model import proxy_config
from bench.harness.steptime import rerun
from bench.harness.train_child import ROOT, thread_env
from selection_callbacks.core.machine_load import LoadSnapshot, other_cpu_seconds
from selection_callbacks.nn.gpt import GPT, GPTConfig
from selection_callbacks.scoring.losses import sequence_means, token_losses

Call = tuple[str, int, int, str]
"""One timed call: (model, rows, length, what): ``what`` is ``fwd`` (no gradients), ``train`` (forward, backward,
AdamW step) or ``grad`` (forward and backward, no optimizer step)."""


def run_models(config: dict[str, Any]) -> dict[str, GPTConfig]:
    """The architectures a run's passes use: ``learner`` (its GPT) and ``proxy``
    (:func:`bench.harness.cost_model.proxy_config`), the latter only for a selector that builds proxies."""
    fields = config["model"]["init_args"]["config"]
    learner = GPTConfig(**{k: v for k, v in fields.items() if k in GPTConfig.__dataclass_fields__})
    proxy = proxy_config(learner, (config.get("selection") or {}).get("init_args") or {})
    return {"learner": learner, **({"proxy": proxy} if proxy else {})}


def run_passes(config: dict[str, Any], metrics: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per counted pass kind (``reference_fwd``, ``learner_reached_bwd``, ...; one-off kinds left out): its model
    (``learner`` or ``proxy``), passes per step and shape (rows, length). Passes of one kind over different row
    counts (an actor's scoring forward over N rows, its training forward over K) are timed at the nearest whole
    rows to their mean and counted at the mean (``scale``: mean rows / timed rows)."""
    selection = metrics.get("selection") or {}
    init = (config.get("selection") or {}).get("init_args") or {}
    seq_len, steps = config["data"]["seq_len"], max(1, metrics["global_step"])
    length = min(init.get("score_len") or seq_len, seq_len)
    out = {}
    for key, counted in (selection.get("cost") or {}).items():
        owner, kind = key.rsplit("_", 1)
        if owner.endswith("_pretrain") or not counted["passes"]:
            continue
        per_pass = counted["tokens"] / counted["passes"]
        rows = per_pass / length
        timed = max(1, round(rows))
        out[key] = {"model": "learner" if owner.startswith("learner") else "proxy", "kind": kind,
                    "per_step": counted["passes"] / steps, "rows": timed, "length": length, "scale": rows / timed}
    return out


def pass_shapes(passes: dict[str, dict[str, Any]]) -> dict[str, list[Call]]:
    """Per pass kind, the timed shapes whose seconds make it: a forward is one ``fwd``; a backward is its training
    pass (``train`` for a proxy, ``grad`` for the learner) minus its ``fwd``."""
    out = {}
    for key, p in passes.items():
        fwd = (p["model"], p["rows"], p["length"], "fwd")
        out[key] = [fwd] if p["kind"] == "fwd" else [(p["model"], p["rows"], p["length"],
                                                      "train" if p["model"] == "proxy" else "grad"), fwd]
    return out


def row_losses(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """[rows] mean next-token cross-entropy of each row, through the scoring path's own functions
    (:func:`token_losses`, :func:`sequence_means`): the log-softmax over the vocabulary that every scoring forward
    pays (at T = 512 through a 4,096-token head, about a fifth of a 2 × 128 proxy's forward)."""
    nll, mask, _ = token_losses(logits, {"labels": targets})
    return sequence_means(nll, mask)


class Timer:
    """Seconds of each shape's pass: after a warm-up call, its mean over repetitions that fill ``budget`` seconds.

    Args:
        models: architectures by name (:func:`run_models`).
        budget: seconds each shape runs per round (its repetitions are set from one warm-up call).
        seed: initialises the models and draws the token ids.
    """

    def __init__(self, models: dict[str, GPTConfig], budget: float = 0.3, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.models = {name: GPT(cfg) for name, cfg in models.items()}
        self.optimizers = {name: torch.optim.AdamW(m.parameters()) for name, m in self.models.items()}
        self.budget = budget

    def call(self, shape: Call) -> None:
        name, rows, length, what = shape
        model = self.models[name]
        ids = torch.randint(0, model.config.vocab_size, (rows, length + 1))
        if what == "fwd":  # a scoring forward: the logits and each row's mean token loss
            with torch.no_grad():
                row_losses(model(ids[:, :-1]), ids[:, 1:])
            return
        logits = model(ids[:, :-1])
        F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten()).backward()
        if what == "train":
            self.optimizers[name].step()
        self.optimizers[name].zero_grad(set_to_none=True)

    def seconds(self, shapes: list[Call]) -> dict[Call, float]:
        """Seconds per shape's pass, the shapes timed one after another."""
        reps = {}
        for shape in shapes:
            self.call(shape)
            start = time.perf_counter()
            self.call(shape)
            reps[shape] = max(1, round(self.budget / max(time.perf_counter() - start, 1e-6)))
        out = {}
        for shape in shapes:
            start = time.perf_counter()
            for _ in range(reps[shape]):
                self.call(shape)
            out[shape] = (time.perf_counter() - start) / reps[shape]
        return out


def run_step(run_dir: Path, steps: int) -> float:
    """Seconds per training step of ``run_dir``'s ``train.py`` run (its config.yaml) re-run in this process for
    ``steps`` steps in a scratch folder: the slope of its training wall-clock between the first and last of 4
    validations.

    Raises:
        ValueError: ``steps`` is not a multiple of 4 of at least 8.
    """
    if steps < 8 or steps % 4:
        raise ValueError(f"--run-steps {steps}: give a multiple of 4, at least 8 (the run validates every steps/4)")
    return rerun(run_dir / "config.yaml", steps, steps // 4)["step_seconds"]


def calibrated(passes: dict[str, dict[str, Any]], seconds: dict[Call, float], step: float) -> dict[str, Any]:
    """``{"ratio", "seconds"}``: the calibrated step ratio and each kind's seconds per step (module docstring)."""
    per_step = {}
    for key, shapes in pass_shapes(passes).items():
        one = seconds[shapes[0]] - (seconds[shapes[1]] if len(shapes) > 1 else 0.0)
        per_step[key] = passes[key]["per_step"] * passes[key].get("scale", 1.0) * max(one, 0.0)
    return {"ratio": 1.0 + sum(per_step.values()) / step, "seconds": per_step}


def _plan(runs: dict[str, list[Path]]) -> tuple[dict[str, GPTConfig], dict[str, list[dict[str, Any]]], Call]:
    """The runs' models, their passes (per method, per run) and the learner's training step shape.

    Raises:
        ValueError: the runs differ in learner, batch or sequence length.
    """
    loaded = {name: [(yaml.safe_load((d / "config.yaml").read_text()), json.loads((d / "metrics.json").read_text()))
                     for d in dirs] for name, dirs in runs.items()}
    configs = [c for pairs in loaded.values() for c, _ in pairs]
    built = [run_models(c) for c in configs]
    settings = [(b["learner"], c["data"]["batch_size"], c["data"]["seq_len"]) for b, c in zip(built, configs)]
    if any(other != settings[0] for other in settings):
        raise ValueError("the runs differ in learner, batch or sequence length: time each setting apart")
    _, batch, seq_len = settings[0]
    models = {name: cfg for b in built for name, cfg in b.items()}
    passes = {name: [run_passes(c, m) for c, m in pairs] for name, pairs in loaded.items()}
    return models, passes, ("learner", batch, seq_len, "train")


def time_round(runs: dict[str, list[Path]], budget: float, run_steps: int, plain_first: bool) -> dict[str, Any]:
    """One round, in this process: each pass shape's seconds, the learner's step, the plain step (random's first run
    re-run for ``run_steps`` steps by :func:`run_step`, before the shapes with ``plain_first``, else after; the
    learner's step when there is no random run or ``run_steps`` is 0) and the CPUs other processes held meanwhile
    (None where the platform does not say)."""
    start = LoadSnapshot.now()
    models, passes, step_shape = _plan(runs)
    shapes = sorted({s for runs_ in passes.values() for p in runs_ for ss in pass_shapes(p).values() for s in ss}
                    | {step_shape})
    plain = runs.get("random", [None])[0] if run_steps else None
    step = run_step(plain, run_steps) if plain and plain_first else None
    seconds = Timer(models, budget=budget).seconds(shapes)
    if plain and not plain_first:
        step = run_step(plain, run_steps)
    end = LoadSnapshot.now()
    other = other_cpu_seconds(start, end)
    return {"seconds": [[*shape, seconds[shape]] for shape in shapes], "learner_step": seconds[step_shape],
            "plain_step": seconds[step_shape] if step is None else step,
            "other_cpus": None if other is None else round(other / (end.wall - start.wall), 3)}


def time_runs(runs: dict[str, list[Path]], threads: int = 1, rounds: int = 5, budget: float = 0.3,
              run_steps: int = 40) -> dict[str, Any]:
    """Per method, the calibrated ratio of each round and their median, each round timed in a fresh process.

    A process's speed on a shared host varies by several percent from one process to the next, and the ratio of
    two models' times in it by a few: every round therefore times the passes and the plain step in one process
    (:func:`time_round`), starting with the plain step in every other round, and the ratio is the median over the
    rounds' ratios. Every run must share one learner, T and batch. The plain step is ``runs["random"]``'s first run
    re-run for ``run_steps`` steps (:func:`run_step`); without a random run (or with ``run_steps`` 0) it is the
    learner's step timed without the Trainer.

    Example:
        >>> # time_runs({"random": [Path("runs/abc/random/seed0")], "rho": [Path("runs/abc/rho/seed0")]})
    """
    _, passes, _ = _plan(runs)  # refuses mixed settings before any round runs
    env = thread_env(threads)
    timed = []
    with tempfile.TemporaryDirectory() as tmp:
        spec = Path(tmp) / "runs.json"
        spec.write_text(json.dumps({name: [str(d.resolve()) for d in dirs] for name, dirs in runs.items()}))
        for r in range(rounds):
            out = Path(tmp) / f"round{r}.json"
            cmd = [sys.executable, "-m", "bench.harness.pass_timing", "--round-of", str(spec), "--round-out", str(out),
                   "--threads", str(threads), "--budget", str(budget), "--run-steps", str(run_steps),
                   "--plain-first", str(r % 2 == 0).lower()]
            done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
            if done.returncode:
                raise RuntimeError(f"pass_timing round {r} failed:\n{done.stderr[-3000:]}")
            timed.append(json.loads(out.read_text()))
    each = []  # per round: per method, per run
    for t in timed:
        seconds = {tuple(row[:4]): row[4] for row in t["seconds"]}
        each.append({name: [calibrated(p, seconds, t["plain_step"]) for p in runs_] for name, runs_ in passes.items()})
    out: dict[str, Any] = {
        "plain_step_seconds": statistics.median(t["plain_step"] for t in timed),
        "learner_step_seconds": statistics.median(t["learner_step"] for t in timed),
        "framework_share": statistics.median(t["plain_step"] / t["learner_step"] - 1 for t in timed),
        "plain_step": "train.py" if run_steps and "random" in runs else "learner", "threads": threads, "rounds": rounds,
        "other_cpus": [t["other_cpus"] for t in timed], "methods": {}}
    for name, runs_ in passes.items():
        ratios = [statistics.mean(c["ratio"] for c in e[name]) for e in each]  # a round's ratio: mean over the runs
        kinds = each[0][name][0]["seconds"]
        out["methods"][name] = {
            "ratio": statistics.median(ratios), "ratios": ratios,
            "seconds_per_step": {k: statistics.median(e[name][0]["seconds"][k] for e in each) for k in kinds},
            "passes": runs_[0]}
    return out


def steptime_runs(folder: Path) -> dict[str, list[Path]]:
    """A steptime folder's run folders by method (``runs/<config>/<method>/seed<r>``)."""
    dirs = sorted(p.parent for p in folder.glob("runs/*/*/seed*/metrics.json"))
    if not dirs:
        raise SystemExit(f"{folder}: no runs/<config>/<method>/seed*/metrics.json; run bench.harness.steptime first")
    out: dict[str, list[Path]] = {}
    for d in dirs:
        out.setdefault(d.parent.name, []).append(d)
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = ArgumentParser(prog="python -m bench.harness.pass_timing", description=__doc__.split("\n\n")[0])
    p.add_argument("folder", nargs="?", help="a bench.harness.steptime --out folder")
    p.add_argument("--threads", type=int, default=1, help="CPU threads (the steptime run's)")
    p.add_argument("--rounds", type=int, default=5, help="rounds, each in a fresh process; the ratio is their median")
    p.add_argument("--budget", type=float, default=0.3, help="seconds each shape runs per round")
    p.add_argument("--run-steps", type=int, default=40,
                   help="steps of each round's train.py re-run of the random run (a multiple of 4; 0: no re-run)")
    p.add_argument("--round-of", help=SUPPRESS)
    p.add_argument("--round-out", help=SUPPRESS)
    p.add_argument("--plain-first", type=bool, default=True, help=SUPPRESS)
    a = p.parse_args(argv)
    if a.round_of:  # one round of time_runs, in its own process
        torch.set_num_threads(a.threads)
        runs = {name: [Path(d) for d in dirs] for name, dirs in json.loads(Path(a.round_of).read_text()).items()}
        result = time_round(runs, a.budget, a.run_steps, a.plain_first)
        Path(a.round_out).write_text(json.dumps(result))
        return result
    if a.folder is None:
        p.error("give a bench.harness.steptime --out folder")
    folder = Path(a.folder)
    result = time_runs(steptime_runs(folder), a.threads, a.rounds, a.budget, a.run_steps)
    (folder / "pass_timing.json").write_text(json.dumps(result, indent=1))
    print(f"[pass_timing] plain step {result['plain_step_seconds'] * 1e3:.1f} ms ({result['plain_step']}), learner "
          f"step {result['learner_step_seconds'] * 1e3:.1f} ms", flush=True)
    for name, m in result["methods"].items():
        spread = f"{min(m['ratios']):.3f}–{max(m['ratios']):.3f}"
        print(f"[pass_timing] {name}: calibrated × {m['ratio']:.3f} (rounds {spread})", flush=True)
    print(f"[pass_timing] other processes held {result['other_cpus']} CPUs, round by round", flush=True)
    return result


if __name__ == "__main__":
    main()
