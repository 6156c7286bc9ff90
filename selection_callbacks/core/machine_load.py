"""How busy the machine was around a run: CPUs used by *other* processes, from ``/proc/stat``.

A timing is comparable with another only if both ran in the same machine state. The machine's
busy CPU-seconds (``/proc/stat``: user, nice, system, irq, softirq, steal) minus this process's
own CPU-seconds, over the elapsed wall seconds, is the mean number of CPUs other work held while
this process ran: about 0 for a run trained alone, about 1 beside one busy single-threaded job.
The 1-minute load average is kept beside it (it counts this process too, and lags by a minute).
Where ``/proc/stat`` is missing (not Linux) only the load average is recorded. ``host_cpu`` names the
processor (``/proc/cpuinfo``): the same code's step-time ratios move with it (an AMX host rounds torch's
bfloat16 products otherwise and runs its matmuls at another speed than an AMD EPYC host).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

BUSY_FIELDS = (0, 1, 2, 5, 6, 7)
"""Columns of the ``cpu`` line of ``/proc/stat`` that count as busy: user, nice, system, irq, softirq, steal."""

ALONE_BELOW = 0.5
"""Other work holding fewer CPUs than this on average counts as 'trained alone'."""


def busy_cpu_seconds(stat: Path = Path("/proc/stat")) -> float | None:
    """CPU-seconds the whole machine has spent busy since boot; None where ``/proc/stat`` is unreadable."""
    try:
        first = stat.read_text().splitlines()[0].split()
    except (OSError, IndexError):
        return None
    if first[0] != "cpu":
        return None
    ticks = [int(first[1 + i]) for i in BUSY_FIELDS if 1 + i < len(first)]
    return sum(ticks) / os.sysconf("SC_CLK_TCK")


def host_cpu(cpuinfo: Path = Path("/proc/cpuinfo")) -> str | None:
    """The processor's model name, with ``"+AMX"`` where it has AMX tile units (``amx_bf16``); None where
    ``/proc/cpuinfo`` is unreadable or names no model."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return None
    model = flags = None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and model is None:
            model = " ".join(value.split())
        elif key == "flags" and flags is None:
            flags = value.split()
    if not model:
        return None
    return f"{model} +AMX" if flags and "amx_bf16" in flags else model


def load_average() -> float | None:
    """The 1-minute load average, None where the platform has none."""
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


@dataclass
class LoadSnapshot:
    """Clocks read at one moment: wall, this process's CPU time, the machine's busy CPU time."""

    wall: float
    own_cpu: float
    busy_cpu: float | None

    @classmethod
    def now(cls) -> LoadSnapshot:
        return cls(time.perf_counter(), time.process_time(), busy_cpu_seconds())


def other_cpu_seconds(start: LoadSnapshot, end: LoadSnapshot) -> float | None:
    """CPU-seconds other processes used between two snapshots (clamped at 0: the clocks tick coarsely)."""
    if start.busy_cpu is None or end.busy_cpu is None:
        return None
    return max(0.0, (end.busy_cpu - start.busy_cpu) - (end.own_cpu - start.own_cpu))


def describe_load(other_cpus: float | None, cpus: int | None) -> str:
    """``'alone'`` or ``'beside ~1.3 CPUs of other work (of 2)'`` for a run's mean other-CPU count."""
    if other_cpus is None:
        return "not recorded"
    if other_cpus < ALONE_BELOW:
        return "alone"
    return f"beside ~{other_cpus:.1f} CPUs of other work" + (f" (of {cpus})" if cpus else "")
