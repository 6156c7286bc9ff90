"""Where a ghost method's selection time goes, part by part, in its own ``train.py`` run.

    python -m bench.studies.ghost_parts bench/results/ladder/steptime-cpu-mini --method opus

The cost model counts a ghost method's passes (the scoring forward and the backward to the earliest scored
layer, whose second unit is the utilities); the step-time check (:mod:`bench.harness.ladder`) leaves the rest of
its measured step ratio as one gap. This study re-runs the method's run of a :mod:`bench.harness.steptime` folder
(its ``config.yaml``, for the folder's steps, validations and threads) with timers around the parts of the
selection, and splits the selection's seconds per step into

- ``forward``: the scoring forward over candidate and target windows, with the capture's forward hooks;
- ``backward``: the capture's backward from the losses to the earliest scored layer (activation gradients), less
  the layer scoring it fires;
- per layer group, as its output gradients arrive: ``factors``, the captured inputs and output gradients in the
  weight's orientation; ``maps``, the target direction ḡ, the optimizer's map P read from its state and
  Q = −Jᵀḡ (and, on logging steps, the factor error of AdamW's map); ``utilities``, u_i = Σ_t b_tᵀ Q a_t;
  ``sketches``, the sketch of each P G_i; where AdamW's map is far from rank one the sketch forms each P G_i and
  reads u_i from it, so there the utilities are timed with the sketches; ``layer_rest``, the rest of the layer
  scoring (grouping, biases, embeddings, the sketch's probe on diagnostic selections, bookkeeping);
- ``grouping``: grouping the captured layers into layer groups, after the forward;
- ``collect``: gathering the passes' utilities, losses and sketches;
- ``step_maps``: building the step's map object from the optimizer;
- ``windows``: drawing the target rows and the candidates' and target rows' scoring windows;
- ``calibrate``: standardising the utilities and the sketches' Gram matrix;
- ``sampling``: the K draws with the redundancy penalty;
- ``rest``: the run's recorded selection seconds (the selection timer the step-time split reads) less the parts
  above: what the selection does around them (checks, the record, the subset, counters).

Each part's time is exclusive (a part timed inside another is taken out of it), so the parts sum to the recorded
selection seconds. The selections between the run's first and last validation count, as in the step-time slope.
A part's share is its seconds over the in-run ratio's denominator (the re-run's step less its selection, plus
random's selection from the folder's ``steptime.json``), so 1 + the shares less random's selection over that
denominator is the re-run's in-run ratio. ``forward``, ``backward`` and ``utilities`` are the counted passes as
they run inside the capture; the calibrated seconds of the same passes (the folder's ``pass_timing.json``) stand
beside them over the same denominator; the other parts are what the cost model leaves out.

Writes ``ghost_parts.json`` into the folder: per method, each part's seconds per step and share, the re-run's step,
selection and in-run ratio, and the calibrated passes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import selection_callbacks.methods  # noqa: F401  (registers every method, so every ghost subclass is wrapped)
from bench.harness.steptime import rerun
from bench.harness.train_child import ROOT, thread_env
from selection_callbacks.callbacks import base
from selection_callbacks.methods.bases import ghost
from selection_callbacks.scoring.ghost import embedding, linear, tied
from selection_callbacks.scoring.ghost.capture import HookCapture
from selection_callbacks.scoring.ghost.engine import GhostEngine

PARTS = ("forward", "backward", "utilities", "factors", "maps", "sketches", "layer_rest", "grouping", "collect",
         "step_maps", "windows", "calibrate", "sampling", "rest")
"""The selection's parts, in the order of the report."""
COUNTED = ("forward", "backward", "utilities")
"""The parts the cost model counts as passes (a forward, and a backward of two units: activation gradients, then
the utilities in place of the weight gradient)."""

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
    base.select_fit = timed(clock, "sampling", base.select_fit)
    ghost._eager_loss = timed(clock, "forward", ghost._eager_loss)
    ghost.score_windows = timed(clock, "windows", ghost.score_windows)
    ghost.GhostSelection._target_batch = timed(clock, "windows", ghost.GhostSelection._target_batch)
    HookCapture.run = timed(clock, "backward", HookCapture.run)  # less the forward and layer scoring, timed inside
    for name, part in (("_arrived", "layer_rest"), ("_groups", "grouping"), ("_collect", "collect")):
        setattr(GhostEngine, name, timed(clock, part, getattr(GhostEngine, name)))
    named = {"factors": "factors", "linear_maps": "maps", "linear_utilities": "utilities", "sketch_linear": "sketches",
             "formed_sketch": "sketches", "embedding_sketch": "sketches"}
    for module in (linear, embedding, tied):  # tied imports its helpers by name: wrapped there too
        for name, part in named.items():
            if hasattr(module, name):
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


def child(config: Path, out: Path, steps: int, every: int) -> None:
    """Run ``config``'s ``train.py`` fit for ``steps`` steps, validating every ``every``, with the parts timed; write
    ``out`` (the parts between the first and last validation, the step and selection seconds)."""
    clock, selections = PartClock(), []
    install(clock, selections)
    timing = rerun(config, steps, every)
    parts = per_step(selections, every, steps)
    parts["rest"] = timing["selection_step_seconds"] - sum(v for k, v in parts.items() if k != "rest")
    out.write_text(json.dumps({"parts": parts, "step_seconds": timing["step_seconds"],
                               "selection_step_seconds": timing["selection_step_seconds"]}))


def method_parts(folder: Path, method: str) -> dict[str, Any]:
    """The parts of ``method``'s run in the steptime ``folder`` (its first run's config, re-run for the folder's steps,
    validations and threads), in seconds per step and as shares of the re-run's in-run step ratio, with the folder's
    calibrated passes (``pass_timing.json``) over the same denominator.

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
    config = steptime["config"]
    random_selection = statistics.median(r["selection_step_seconds"] for r in steptime["methods"]["random"]["runs"])
    env = thread_env(config["threads"])
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "parts.json"
        cmd = [sys.executable, "-m", "bench.studies.ghost_parts", "--child", str(runs[0].resolve()), "--child-out",
               str(out), "--steps", str(config["steps"]), "--every", str(config["eval_every"])]
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"timing {method}'s parts failed:\n{done.stderr[-3000:]}")
        measured = json.loads(out.read_text())
    denominator = measured["step_seconds"] - measured["selection_step_seconds"] + random_selection
    passes = timing["methods"][method]["seconds_per_step"]  # the calibrated seconds of the counted passes
    shares = {name: seconds / denominator for name, seconds in measured["parts"].items()}
    return {**measured, "run": str(runs[0].parent), "steps": config["steps"], "every": config["eval_every"],
            "threads": config["threads"], "random_selection_seconds": random_selection,
            "base_seconds": denominator, "in_run_ratio": measured["step_seconds"] / denominator, "shares": shares,
            "counted_share": sum(shares[k] for k in COUNTED),
            "left_out_share": sum(v for k, v in shares.items() if k not in COUNTED),
            "calibrated_passes": passes, "calibrated_share": sum(passes.values()) / denominator}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m bench.studies.ghost_parts", description=__doc__.split("\n\n")[0])
    p.add_argument("folder", nargs="?", type=Path, help="a bench.harness.steptime --out folder (with pass_timing.json)")
    p.add_argument("--method", action="append", help="a ghost method the folder timed (repeat; default: opus)")
    p.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--child-out", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--steps", type=int, help=argparse.SUPPRESS)
    p.add_argument("--every", type=int, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        child(a.child, a.child_out, a.steps, a.every)
        return {}
    if a.folder is None:
        p.error("give a steptime folder")
    result = {"methods": {m: method_parts(a.folder, m) for m in a.method or ["opus"]}}
    (a.folder / "ghost_parts.json").write_text(json.dumps(result, indent=1))
    for name, m in result["methods"].items():
        shares = ", ".join(f"{k} {v:.3f}" for k, v in m["shares"].items())
        print(f"[ghost_parts] {name}: in-run × {m['in_run_ratio']:.3f} = 1 + {shares} − random's selection", flush=True)
    return result


if __name__ == "__main__":
    main()
