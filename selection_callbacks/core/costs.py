"""What each stage of a long computation costs: wall seconds and the process's peak resident memory.

Peak memory is the kernel's high-water mark of this process's resident set (``VmHWM``). On Linux it
is reset at the start of each stage (``/proc/self/clear_refs``), so a stage's figure is its own
peak; where the reset is refused the figure is the peak of the process so far (``since_start``).

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

__all__ = ["StageCosts", "peak_rss_mb", "reset_peak_rss"]

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


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
