"""``make demo``: tuned random and RHO-LOSS on 16-token windows, trained side by side on one seed.

    python -m bench.harness.demo --data data/default --out runs/demo --steps 1000

Two ``train.py`` runs start at once, one CPU thread each (``OMP_NUM_THREADS=1``): random selection
and RHO-LOSS scored on a seeded 16-token window of each candidate (``configs/method/rho_windows.yaml``:
``rho.yaml`` with ``score_len`` 16), both under the tuned AdamW baseline
(``configs/scale/cpu-tiny.yaml`` + ``configs/tuned/cpu-tiny-adamw.yaml``). They share the seed
(``seed_everything`` and ``data.seed``: the same initial model and the same stream of candidate
superbatches), the budget (``--steps`` steps of 16 kept sequences × 128 tokens, K = 16 of N = 32
candidates a step: equal update tokens) and the learning-rate schedule, which decays over
``--steps``. Each validates ``--evals`` times, at every ``--steps / --evals`` steps. The defaults
(1000 steps, 10 validations, seed 0) are the budget and validation points of ``bench.harness.compare``'s
default-corpus comparison, so the two runs are its seed-0 runs of ``random`` and ``rho@score_len=16``.

While they train, one line per run every ``--progress_every`` seconds (its latest ``[train]`` line).
Then a table:

- final val bpb of each run, and Δ = RHO-LOSS's − random's (negative: RHO-LOSS is better);
- train seconds: each run's training wall-clock with validation left out (``metrics.json``);
  RHO-LOSS's holds the pretraining of its reference on the target split (``reference_steps``);
- wall-clock to random's final bpb: the first training second at which the run's val bpb is at
  most random's final val bpb, linearly interpolated between validations
  (:func:`bench.harness.report.crossing`), in seconds and as a fraction of random's train seconds;
- update tokens to random's final bpb: the same crossing over update tokens.

``OUT/demo.json`` holds these numbers with both curves, each run's CPU seconds (user + system: its
wall-clock on a core of its own) and the machine's load (``uptime``'s 1-minute average before and
after, and each run's ``machine`` record from ``metrics.json``); ``OUT/demo.png`` plots val bpb
against update tokens and against train seconds, with random's final bpb as a line.

Example, a short run at a smaller context (flags after ``--`` go to both runs)::

    python -m bench.harness.demo --out runs/demo-short --steps 200 --evals 4 -- --data.seq_len 64
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from jsonargparse import ArgumentParser

from bench.harness.report import crossing
from bench.harness.train_child import fit_command, thread_env

BASELINE = ["configs/scale/cpu-tiny.yaml", "configs/tuned/cpu-tiny-adamw.yaml"]
RUNS = {
    "random": ["configs/method/random.yaml"],
    "rho@score_len=16": ["configs/method/rho_windows.yaml"],
}
"""Run name → its method config and flags; the first is the baseline the other is measured against."""


@dataclass
class Run:
    """One ``train.py`` subprocess: its folder, log, exit code and CPU seconds once it has ended."""

    name: str
    folder: Path
    process: subprocess.Popen
    log: TextIO
    exit_code: int | None = None
    cpu_seconds: float | None = None

    def poll(self) -> bool:
        """Whether the process has ended; reaps it and records its exit code and CPU seconds (user + system)."""
        if self.exit_code is None:
            pid, status, usage = os.wait4(self.process.pid, os.WNOHANG)
            if pid == 0:
                return False
            self.exit_code = self.process.returncode = os.waitstatus_to_exitcode(status)
            self.cpu_seconds = round(usage.ru_utime + usage.ru_stime, 1)
            self.log.close()
        return True

    def latest(self) -> str:
        """The last ``[train]`` line of its log (or the reference pretraining notice, or 'starting')."""
        text = (self.folder / "train.log").read_text(errors="replace").splitlines()
        lines = [line for line in text if line.startswith("[train]") or "pretraining the reference" in line]
        return lines[-1] if lines else "starting"


def train_command(name: str, args: Any) -> list[str]:
    """The ``train.py fit`` command of run ``name`` under the demo's seed, budget and data, ``args.extra`` last."""
    config, *flags = RUNS[name]
    data = Path(args.data)
    cmd = fit_command([*BASELINE, config], args.seed, data / "pool.jsonl", data / "target.jsonl", data / "val.jsonl",
                      args.steps, max(1, args.steps // args.evals), Path(args.out) / name)
    return cmd + [*flags, "--ledger.enabled", "false", "--recorder.progress_every", str(args.progress_every), *args.extra]


def launch(args: Any) -> list[Run]:
    """Starts every run of ``RUNS`` at once, one thread each, its output to ``OUT/<name>/train.log``."""
    env = thread_env(1)
    runs = []
    for name in RUNS:
        folder = Path(args.out) / name
        folder.mkdir(parents=True, exist_ok=True)
        log = open(folder / "train.log", "w")
        process = subprocess.Popen(train_command(name, args), stdout=log, stderr=subprocess.STDOUT, env=env)
        runs.append(Run(name, folder, process, log))
    return runs


def watch(runs: list[Run], every: float) -> None:
    """Waits for every run, printing each one's latest progress every ``every`` seconds.

    Raises:
        SystemExit: a run exits with a non-zero code (the others are stopped).
    """
    start = last = time.perf_counter()
    while not all(run.poll() for run in runs):
        stop_on_failure(runs)
        time.sleep(0.5)
        if time.perf_counter() - last >= every:
            last = time.perf_counter()
            for run in runs:
                print(f"[demo] {last - start:4.0f} s · {run.name}: {run.latest()}", flush=True)
    stop_on_failure(runs)


def stop_on_failure(runs: list[Run]) -> None:
    """Stops the runs still going once one has exited with a non-zero code, and raises SystemExit naming its log."""
    failed = [run for run in runs if run.exit_code not in (None, 0)]
    if not failed:
        return
    for run in runs:
        if run.exit_code is None:
            run.process.terminate()
            run.process.wait()
    raise SystemExit(f"[demo] {failed[0].name} failed (exit {failed[0].exit_code}); see {failed[0].folder / 'train.log'}")


def compare(metrics: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per run: final val bpb, Δ against the baseline (the first run), train seconds, and the wall-clock
    and update tokens at which its curve first reaches the baseline's final val bpb (None: never)."""
    base_name = next(iter(metrics))
    base = metrics[base_name]
    target, base_seconds, base_tokens = base["curve"][-1][2], base["curve"][-1][1], base["curve"][-1][0]
    out = {}
    for name, m in metrics.items():
        seconds, tokens = crossing(m["curve"], target, 1), crossing(m["curve"], target, 0)
        out[name] = {
            "final_val_bpb": m["curve"][-1][2],
            "delta": m["curve"][-1][2] - target,
            "train_seconds": m["curve"][-1][1],
            "seconds_to_baseline_final": seconds,
            "wall_to_baseline_final": None if seconds is None else seconds / base_seconds,
            "tokens_to_baseline_final": None if tokens is None else tokens / base_tokens,
        }
    return out


def table(summary: dict[str, dict[str, Any]]) -> str:
    """The comparison as a markdown table (Δ and the crossings against the first run)."""
    lines = [
        "| run | final val bpb | Δ vs random | train seconds | wall-clock to random's final bpb | update tokens to random's final bpb |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, s in summary.items():
        wall = "not reached" if s["seconds_to_baseline_final"] is None else (
            f"{s['seconds_to_baseline_final']:.0f} s ({s['wall_to_baseline_final']:.2f}×)")
        tokens = "not reached" if s["tokens_to_baseline_final"] is None else f"{s['tokens_to_baseline_final']:.2f}×"
        lines.append(f"| {name} | {s['final_val_bpb']:.4f} | {s['delta']:+.4f} | {s['train_seconds']:.0f} | {wall} | {tokens} |")
    return "\n".join(lines) + "\n"


def plot(metrics: dict[str, dict[str, Any]], summary: dict[str, dict[str, Any]], path: Path) -> None:
    """Two panels, val bpb against update tokens and against train seconds, with the baseline's final bpb as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    base_name = next(iter(metrics))
    target = summary[base_name]["final_val_bpb"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for ax, column, xlabel in ((axes[0], 0, "update tokens (millions)"), (axes[1], 1, "train wall-clock (s, validation left out)")):
        scale = 1e-6 if column == 0 else 1.0
        for name, m in metrics.items():
            xs, ys = [p[column] * scale for p in m["curve"]], [p[2] for p in m["curve"]]
            ax.plot(xs, ys, marker="o", markersize=3, label=name)
        ax.axhline(target, color="grey", linestyle="--", linewidth=1, label=f"{base_name}'s final bpb ({target:.3f})")
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
    for name, s in summary.items():
        if name != base_name and s["seconds_to_baseline_final"] is not None:
            axes[1].plot([s["seconds_to_baseline_final"]], [target], marker="x", color="black")
            axes[1].annotate(f"{name} reaches {base_name}'s final bpb\nat {s['seconds_to_baseline_final']:.0f} s, "
                             f"{s['wall_to_baseline_final']:.2f}× {base_name}'s {summary[base_name]['train_seconds']:.0f} s",
                             (s["seconds_to_baseline_final"], target), xytext=(0.03, 0.06), textcoords="axes fraction", fontsize=8,
                             arrowprops={"arrowstyle": "->", "color": "grey"})
    axes[0].set_ylabel("val bpb (lower is better)")
    axes[0].set_title("val bpb at equal update tokens")
    axes[1].set_title("val bpb against wall-clock")
    axes[0].legend(fontsize=8)
    tokens = metrics[base_name]["curve"][-1][0]
    fig.suptitle(f"{' vs '.join(metrics)}: {tokens:,} update tokens each, one seed, tuned AdamW, cpu-tiny GPT, one CPU thread each")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def load_average() -> float:
    """``uptime``'s 1-minute load average."""
    return round(os.getloadavg()[0], 2)


def build_parser() -> ArgumentParser:
    """The ``bench.harness.demo`` arguments."""
    p = ArgumentParser(prog="python -m bench.harness.demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--data", type=str, default="data/default", help="folder holding pool.jsonl, target.jsonl and val.jsonl")
    p.add_argument("--out", type=str, default="runs/demo", help="folder for the runs, demo.json and demo.png")
    p.add_argument("--steps", type=int, default=1000, help="training steps of each run (16 × 128 update tokens each)")
    p.add_argument("--evals", type=int, default=10, help="validations per run, evenly spaced")
    p.add_argument("--seed", type=int, default=0, help="seed of both runs (model init and candidate stream)")
    p.add_argument("--progress_every", type=float, default=15.0, help="seconds between progress lines")
    p.add_argument("extra", nargs="*", default=[], help="extra train.py flags for both runs after --, e.g. -- --data.seq_len 64")
    return p


def main(argv: list[str] | None = None) -> dict[str, Any]:
    a = build_parser().parse_args(argv)
    out = Path(a.out)
    print(f"[demo] {' and '.join(RUNS)} side by side: {a.steps} steps ({a.steps * 16 * 128:,} update tokens) each, "
          f"seed {a.seed}, one thread each; logs under {out}/<run>/train.log", flush=True)
    began, load_before = time.perf_counter(), load_average()
    runs = launch(a)
    watch(runs, a.progress_every)
    metrics = {run.name: json.loads((run.folder / "metrics.json").read_text()) for run in runs}
    summary = compare(metrics)
    seconds = round(time.perf_counter() - began, 1)
    result = {
        "steps": a.steps, "update_tokens": metrics[runs[0].name]["update_tokens"], "seed": a.seed, "evals": a.evals,
        "seconds": seconds, "load_average": {"before": load_before, "after": load_average()},
        "runs": {run.name: {**summary[run.name], "cpu_seconds": run.cpu_seconds, "curve": metrics[run.name]["curve"],
                            "machine": metrics[run.name].get("machine"), "command": train_command(run.name, a)}
                 for run in runs},
    }
    (out / "demo.json").write_text(json.dumps(result, indent=1))
    plot(metrics, summary, out / "demo.png")
    print(table(summary), end="")
    cpu = ", ".join(f"{run.name} {run.cpu_seconds:.0f}" for run in runs)
    print(f"[demo] {seconds:.0f} s in all; CPU seconds per run: {cpu}; 1-minute load average {load_before} before, "
          f"{result['load_average']['after']} after (the demo's two runs count in it)\n[demo] {out / 'demo.json'}, {out / 'demo.png'}")
    return result


if __name__ == "__main__":
    main()
