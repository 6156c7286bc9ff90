"""Machine load around a run: other processes' CPUs from /proc/stat, recorded by RunRecorder."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from selection_callbacks.core.machine_load import (
    LoadSnapshot,
    busy_cpu_seconds,
    describe_load,
    host_cpu,
    other_cpu_seconds,
)


def test_busy_seconds_sum_the_busy_columns(tmp_path: Path) -> None:
    import os

    stat = tmp_path / "stat"
    # user nice system idle iowait irq softirq steal
    stat.write_text("cpu  100 20 30 9999 50 1 2 3 0 0\ncpu0 1 2 3 4\n")
    assert busy_cpu_seconds(stat) == pytest.approx((100 + 20 + 30 + 1 + 2 + 3) / os.sysconf("SC_CLK_TCK"))
    assert busy_cpu_seconds(tmp_path / "missing") is None


def test_host_cpu_names_the_model_and_amx(tmp_path: Path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: Intel(R) Xeon(R)  Platinum 8488C\nflags\t\t: fpu sse2 amx_bf16 amx_tile\n\n"
                    "processor\t: 1\nmodel name\t: Intel(R) Xeon(R)  Platinum 8488C\nflags\t\t: fpu sse2 amx_bf16 amx_tile\n")
    assert host_cpu(info) == "Intel(R) Xeon(R) Platinum 8488C +AMX"
    info.write_text("processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu sse2 avx2\n")
    assert host_cpu(info) == "AMD EPYC"
    info.write_text("processor\t: 0\nflags\t\t: fpu\n")  # some platforms name no model
    assert host_cpu(info) is None
    assert host_cpu(tmp_path / "missing") is None


def test_other_cpu_seconds_subtract_the_own_process() -> None:
    start, end = LoadSnapshot(0.0, 1.0, 10.0), LoadSnapshot(2.0, 2.5, 13.0)
    assert other_cpu_seconds(start, end) == pytest.approx(1.5)  # 3 busy seconds, 1.5 of them ours
    assert other_cpu_seconds(start, LoadSnapshot(2.0, 2.5, None)) is None
    assert describe_load(0.1, 2) == "alone" and describe_load(1.26, 2) == "beside ~1.3 CPUs of other work (of 2)"
    assert describe_load(None, 2) == "not recorded"


@pytest.mark.skipif(not Path("/proc/stat").exists(), reason="needs /proc/stat (Linux)")
def test_a_busy_neighbour_is_seen_and_the_own_work_is_not() -> None:
    start = LoadSnapshot.now()
    t = time.perf_counter()
    while time.perf_counter() - t < 0.6:  # our own busy work: not other processes'
        pass
    own = LoadSnapshot.now()
    child = subprocess.Popen([sys.executable, "-c", "import time\nt=time.time()\nwhile time.time()-t<1.5: pass"])
    child.wait()
    end = LoadSnapshot.now()
    with_child = other_cpu_seconds(own, end) / (end.wall - own.wall)
    assert with_child > 0.5, with_child  # the child held about one CPU for most of the span
    assert other_cpu_seconds(start, own) < other_cpu_seconds(own, end)
