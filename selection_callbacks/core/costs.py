"""What selection costs: the passes a selector runs beside training (``CostMeter``) and what each stage of a long
computation costs (``StageCosts``).

``CostMeter`` counts the forward and backward passes and their tokens per model: a selector's cost model's input.

``StageCosts`` holds each stage's wall seconds and the process's peak resident memory. Peak memory is the kernel's
high-water mark of this process's resident set (``VmHWM``). On Linux it is reset at the start of each stage
(``/proc/self/clear_refs``), so a stage's figure is its own peak; where the reset is refused the figure is the peak
of the process so far (``since_start``).

Example::

    costs = StageCosts()
    with costs.stage("proxy train"):
        train()
    print(costs.table("feature bank"))
    costs.as_dict()     # {"proxy train": {"seconds": 12.3, "peak_rss_mb": 812.0}, ...}
"""

from __future__ import annotations

import resource
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

__all__ = ["CostMeter", "StageCosts", "peak_rss_mb", "reset_peak_rss"]

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


class CostMeter:
    """Forward/backward passes and tokens per model (``learner``, ``online``, ``reference``).

    A pass is one call on one batch; its tokens are ``input_ids.numel()``. Counts are this
    process's work: this micro-batch (reset by :meth:`new_step`) and cumulative.
    """

    KINDS = ("fwd", "bwd")

    def __init__(self) -> None:
        self.step: dict[str, list[int]] = {}
        self.total: dict[str, list[int]] = {}

    def add(self, model: str, kind: str, tokens: int) -> None:
        """Count one ``kind`` pass ("fwd"/"bwd") of ``model`` over ``tokens`` tokens."""
        for table in (self.step, self.total):
            entry = table.setdefault(f"{model}_{kind}", [0, 0])
            entry[0] += 1
            entry[1] += tokens

    def new_step(self) -> None:
        self.step = {}

    def metrics(self, kept_tokens: int) -> dict[str, float]:
        """``select/cost/<model>_<kind>[_tokens][_total]`` and, per kind, extra tokens over the kept tokens.

        ``select/cost/fwd_per_update`` = Σ forward tokens this micro-batch / K·T: the report's
        "3 fwd + 1 bwd" unit (passes over a batch the size of what the learner trains on).
        """
        out: dict[str, float] = {}
        for key, (passes, tokens) in self.total.items():
            out[f"select/cost/{key}_total"] = float(passes)
            out[f"select/cost/{key}_tokens_total"] = float(tokens)
            step_passes, step_tokens = self.step.get(key, (0, 0))
            out[f"select/cost/{key}"] = float(step_passes)
            out[f"select/cost/{key}_tokens"] = float(step_tokens)
        for kind in self.KINDS:
            tokens = sum(t for key, (_, t) in self.step.items() if key.endswith(kind))
            out[f"select/cost/{kind}_per_update"] = tokens / kept_tokens if kept_tokens else 0.0
        return out

    def state_dict(self) -> dict[str, Any]:
        return {key: list(value) for key, value in self.total.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.total = {key: [int(v) for v in value] for key, value in state.items()}


def peak_rss_mb() -> float:
    """The process's resident-memory high-water mark in MB (10⁶ bytes)."""
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024 / 1e6
    except OSError:
        pass
    scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, KiB on Linux
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale / 1e6


def reset_peak_rss() -> bool:
    """Reset the high-water mark to the current resident set; False where the platform refuses."""
    try:
        _CLEAR_REFS.write_text("5")
    except OSError:
        return False
    return True


class StageCosts:
    """Seconds and peak memory per named stage, in the order the stages ran."""

    def __init__(self) -> None:
        self.stages: dict[str, dict[str, float]] = {}
        self.per_stage_peak = True

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        self.per_stage_peak &= reset_peak_rss()
        start = time.perf_counter()
        try:
            yield
        finally:
            seconds = time.perf_counter() - start
            entry = self.stages.setdefault(name, {"seconds": 0.0, "peak_rss_mb": 0.0})
            entry["seconds"] = round(entry["seconds"] + seconds, 2)
            entry["peak_rss_mb"] = round(max(entry["peak_rss_mb"], peak_rss_mb()), 1)

    @property
    def seconds(self) -> float:
        return round(sum(s["seconds"] for s in self.stages.values()), 2)

    def as_dict(self) -> dict[str, dict[str, float]]:
        return {name: dict(s) for name, s in self.stages.items()}

    def table(self, title: str) -> str:
        """One line per stage (its other entries, e.g. ``train_seconds``, in brackets) and a total."""
        peak = "peak MB" if self.per_stage_peak else "peak MB (process so far)"
        lines = [f"[{title}] {'stage':<10s} {'seconds':>9s} {peak:>10s}"]
        for name, s in self.stages.items():
            extra = ", ".join(f"{k.removesuffix('_seconds')} {v:.1f} s" for k, v in s.items()
                              if k not in ("seconds", "peak_rss_mb"))
            line = f"[{title}] {name:<10s} {s['seconds']:>9.1f} {s['peak_rss_mb']:>10.0f}"
            lines.append(line + (f"  ({extra})" if extra else ""))
        top = max((s["peak_rss_mb"] for s in self.stages.values()), default=0.0)
        lines.append(f"[{title}] {'total':<10s} {self.seconds:>9.1f} {top:>10.0f}")
        return "\n".join(lines)
