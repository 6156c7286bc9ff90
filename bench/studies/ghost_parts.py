"""Where a ghost method's selection time goes, part by part, in its own ``train.py`` run.

    python -m bench.studies.ghost_parts bench/results/ladder/steptime-cpu-mini --method opus

The cost model counts a ghost method's passes (the scoring forward and the backward to the earliest scored
layer); the step-time check (:mod:`bench.harness.ladder`) leaves the rest of its measured step ratio as one gap.
This study re-runs the method's run of a :mod:`bench.harness.steptime` folder (its ``config.yaml``, one thread)
with timers around the parts of the selection, and splits the selection's seconds per step into

- ``forward``: the scoring forward over candidate and proxy windows, with the capture's forward hooks;
- ``backward``: autograd's backward from the losses to the earliest scored layer, less the layer scoring it fires;
- per layer group, as its output gradients arrive: ``factors``, stacking the captured inputs and output gradients;
  ``maps``, the proxy direction ḡ, the optimizer's map P read from its state and Q = −Jᵀḡ (and, on logging steps,
  the factor error of AdamW's map); ``utilities``, u_i = Σ_t b_tᵀ Q a_t; ``sketches``, the sketch of each P G_i;
  ``layer_rest``, the rest of the layer scoring (biases, embedding rows, norms, bookkeeping);
- ``grouping``: stacking the captured layers into groups, after the forward;
- ``collect``: gathering the passes' utilities, losses and sketches;
- ``step_maps``: building the step's map object from the optimizer;
- ``windows``: drawing the proxy rows and the candidates' and proxy rows' scoring windows;
- ``calibrate``: standardising the utilities and the sketches' Gram matrix;
- ``sampling``: the K draws with the redundancy penalty;
- ``rest``: the run's recorded selection seconds (the selection timer the step-time split reads) less the parts
  above: what the selection does around them (checks, the record, the subset, counters).

Each part's time is exclusive (a part timed inside another is taken out of it), so the parts sum to the recorded
selection seconds. The selections of the steps between
the run's first and last validation count, as in the step-time slope. A part's share is its seconds over the
in-run ratio's denominator (the re-run's step less its selection, plus random's selection from the folder's
``steptime.json``), so 1 + the shares less random's selection over that denominator is the re-run's in-run ratio:
``forward`` and ``backward`` are the counted passes as they run inside the capture (the calibrated seconds of the
same passes, from the folder's ``pass_timing.json``, stand beside them), the other parts are what the cost model
leaves out.

Writes ``ghost_parts.json`` into the folder: per method, each part's seconds per step and share, the re-run's step,
selection and in-run ratio, and the calibrated passes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

import selection_callbacks.methods  # noqa: F401  (registers every method, so every ghost subclass is wrapped)
from bench.harness.methods import ROOT
from bench.harness.steptime import measure
from selection_callbacks.callbacks import base
from selection_callbacks.methods.bases import ghost
from selection_callbacks.scoring.ghost import embedding, linear
from selection_callbacks.scoring.ghost.engine import GhostEngine

PARTS = ("forward", "backward", "factors", "maps", "utilities", "sketches", "layer_rest", "grouping", "collect",
         "step_maps", "windows", "calibrate", "sampling", "rest")
"""The selection's parts, in the order of the report."""

RUN_STEPS = 120
"""Steps of the re-run; it validates every quarter, so the parts are averaged over the last 90 steps' selections."""


class PartClock:
    """Exclusive seconds per part of the current selection: a part entered inside another is taken out of it.

    Example:
        >>> clock = PartClock()
        >>> with clock.part("rest"):
        ...     with clock.part("sampling"):
        ...         pass
        >>> sorted(clock.current)
        ['rest', 'sampling']
    """

    def __init__(self) -> None:
        self.current: dict[str, float] = {}
        self._stack: list[list[float]] = []  # [start, seconds of the parts entered inside]

    @contextmanager
    def part(self, name: str):
        frame = [time.perf_counter(), 0.0]
        self._stack.append(frame)
        try:
            yield
        finally:
            elapsed = time.perf_counter() - frame[0]
            self._stack.pop()
            if self._stack:
                self._stack[-1][1] += elapsed
            self.current[name] = self.current.get(name, 0.0) + elapsed - frame[1]

    @property
    def active(self) -> bool:
        return bool(self._stack)


def timed(clock: PartClock, name: str, fn: Callable) -> Callable:
    """``fn`` with its calls inside a selection counted under ``name``."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not clock.active:
            return fn(*args, **kwargs)
        with clock.part(name):
            return fn(*args, **kwargs)

    return wrapper


def install(clock: PartClock, selections: list[tuple[int, dict[str, float]]]) -> None:
    """Wrap the selection's parts with ``clock``; each selection's parts go to ``selections`` with its step."""
    hook = base.SelectionCallback.on_train_batch_start

    def selection(self, trainer, *args, **kwargs):
        clock.current = {}
        with clock.part("rest"):
            out = hook(self, trainer, *args, **kwargs)
        selections.append((trainer.global_step, clock.current))
        return out

    base.SelectionCallback.on_train_batch_start = selection
    base.select = timed(clock, "sampling", base.select)
    ghost._eager_loss = timed(clock, "forward", ghost._eager_loss)
    ghost.score_windows = timed(clock, "windows", ghost.score_windows)
    ghost.GhostSelection._proxy_rows = timed(clock, "windows", ghost.GhostSelection._proxy_rows)
    torch.autograd.grad = timed(clock, "backward", torch.autograd.grad)
    for name, part in (("_arrived", "layer_rest"), ("_groups", "grouping"), ("_collect", "collect")):
        setattr(GhostEngine, name, timed(clock, part, getattr(GhostEngine, name)))
    for module, name, part in ((linear, "factors", "factors"), (linear, "linear_maps", "maps"),
                               (linear, "linear_utilities", "utilities"), (linear, "sketch_linear", "sketches"),
                               (linear, "formed_sketch", "sketches"), (embedding, "embedding_sketch", "sketches")):
        setattr(module, name, timed(clock, part, getattr(module, name)))
    for cls in _subclasses(ghost.GhostSelection):
        for name, part in (("step_maps", "step_maps"), ("calibrate", "calibrate")):
            if name in vars(cls):
                setattr(cls, name, timed(clock, part, vars(cls)[name]))


def _subclasses(cls: type) -> list[type]:
    out, todo = [], [cls]
    while todo:
        c = todo.pop()
        out.append(c)
        todo.extend(c.__subclasses__())
    return out


def per_step(selections: list[tuple[int, dict[str, float]]], first: int, last: int) -> dict[str, float]:
    """Mean seconds per selection of each part over the selections of steps ``first`` ≤ step < ``last``."""
    kept = [parts for step, parts in selections if first <= step < last]
    if not kept:
        raise ValueError(f"no selection between steps {first} and {last}")
    return {name: sum(p.get(name, 0.0) for p in kept) / len(kept) for name in PARTS}


def child(config: Path, out: Path, steps: int) -> None:
    """Run ``config``'s ``train.py`` fit for ``steps`` steps with the parts timed; write ``out`` (parts, step times)."""
    clock, selections = PartClock(), []
    install(clock, selections)
    import train

    with tempfile.TemporaryDirectory() as tmp:
        train.main(["fit", "--config", str(config), "--trainer.max_steps", str(steps),
                    "--trainer.val_check_interval", str(steps // 4), "--trainer.default_root_dir", tmp])
        timing = measure(Path(tmp), steps // 4)
    first = steps // 4  # the slope's validation points: after steps/4 and after steps
    parts = per_step(selections, first, steps)
    parts["rest"] = timing["selection_step_seconds"] - sum(v for k, v in parts.items() if k != "rest")
    out.write_text(json.dumps({"parts": parts, "step_seconds": timing["step_seconds"],
                               "selection_step_seconds": timing["selection_step_seconds"]}))


def method_parts(folder: Path, method: str, threads: int, steps: int) -> dict[str, Any]:
    """The parts of ``method``'s run in the steptime ``folder`` (its first run's config), in seconds per step and as
    shares of its re-run's in-run step ratio, with the folder's calibrated passes (``pass_timing.json``).

    A part's share is its seconds over the re-run's step less its selection plus random's selection (the folder's
    random runs, median): the in-run ratio's denominator (:func:`bench.harness.steptime.in_run_ratio`), so
    1 + Σ shares − random's selection over it is the re-run's in-run ratio.
    """
    runs = sorted(folder.glob(f"runs/*/{method}/seed*/config.yaml"))
    if not runs:
        raise SystemExit(f"{folder}: no runs/<config>/{method}/seed*/config.yaml; run bench.harness.steptime first")
    timing_path, steptime_path = folder / "pass_timing.json", folder / "steptime.json"
    for path, made_by in ((steptime_path, "bench.harness.steptime"), (timing_path, "bench.harness.pass_timing")):
        if not path.exists():
            raise SystemExit(f"{path} is missing: run python -m {made_by} first")
    timing, steptime = json.loads(timing_path.read_text()), json.loads(steptime_path.read_text())
    random_selection = statistics.median(r["selection_step_seconds"] for r in steptime["methods"]["random"]["runs"])
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "parts.json"
        cmd = [sys.executable, "-m", "bench.studies.ghost_parts", "--child", str(runs[0]), "--child-out", str(out),
               "--steps", str(steps)]
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"timing {method}'s parts failed:\n{done.stderr[-3000:]}")
        measured = json.loads(out.read_text())
    base = measured["step_seconds"] - measured["selection_step_seconds"] + random_selection
    passes = timing["methods"][method]["seconds_per_step"]  # the calibrated seconds of the counted passes
    shares = {name: seconds / base for name, seconds in measured["parts"].items()}
    return {**measured, "run": str(runs[0].parent), "random_selection_seconds": random_selection, "base_seconds": base,
            "in_run_ratio": measured["step_seconds"] / base, "shares": shares,
            "left_out_share": sum(v for k, v in shares.items() if k not in ("forward", "backward")),
            "calibrated_passes": passes}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m bench.studies.ghost_parts", description=__doc__.split("\n\n")[0])
    p.add_argument("folder", nargs="?", type=Path, help="a bench.harness.steptime --out folder (with pass_timing.json)")
    p.add_argument("--method", action="append", help="a ghost method the folder timed (repeat; default: opus)")
    p.add_argument("--threads", type=int, default=1, help="CPU threads (the steptime run's)")
    p.add_argument("--steps", type=int, default=RUN_STEPS, help="steps of the re-run (a multiple of 4)")
    p.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--child-out", type=Path, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.steps < 8 or a.steps % 4:
        raise SystemExit(f"--steps {a.steps}: give a multiple of 4, at least 8 (the run validates every steps/4)")
    if a.child:
        child(a.child, a.child_out, a.steps)
        return {}
    if a.folder is None:
        p.error("give a steptime folder")
    result = {"threads": a.threads, "steps": a.steps,
              "methods": {m: method_parts(a.folder, m, a.threads, a.steps) for m in a.method or ["opus"]}}
    (a.folder / "ghost_parts.json").write_text(json.dumps(result, indent=1))
    for name, m in result["methods"].items():
        shares = ", ".join(f"{k} {v:.3f}" for k, v in m["shares"].items())
        print(f"[ghost_parts] {name}: in-run × {m['in_run_ratio']:.3f} = 1 + {shares} − random's selection", flush=True)
    return result


if __name__ == "__main__":
    main()
