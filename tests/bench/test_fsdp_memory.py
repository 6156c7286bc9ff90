"""bench.studies.fsdp_memory: the profiler's allocator events give a call's peak, and the study runs end to end."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from bench.studies.fsdp_memory import main, peak_of


def test_peak_is_the_largest_running_sum_of_allocations() -> None:
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        a = torch.empty(1_000_000)  # 4 MB
        b = torch.empty(500_000)  # 2 MB: 6 MB live
        del a, b
        c = torch.empty(250_000)  # 1 MB after both were freed
        del c
    assert peak_of(prof) == 6_000_000


def test_sharded_scoring_holds_less_than_replicated(tmp_path: Path) -> None:
    """A tiny GPT on 2 gloo processes per layout: the FSDP2 ranks hold half the parameter and moment bytes and peak lower."""
    result = main(["--layers", "2", "--width", "64", "--candidates", "8", "--target-rows", "2", "--out", str(tmp_path)])
    ddp, fsdp2 = result["runs"]["ddp"], result["runs"]["fsdp2"]
    assert all(r["held_bytes"] == ddp[0]["held_bytes"] for r in ddp)
    assert sum(r["held_bytes"] for r in fsdp2) <= ddp[0]["held_bytes"] * 1.01  # shards add up to one replica (padding aside)
    assert all(r["call_peak_bytes"] > 0 for r in ddp + fsdp2)
    assert result["fsdp2_peak_bytes"] < result["ddp_peak_bytes"]
    assert json.loads((tmp_path / "fsdp_memory.json").read_text())["removed_bytes"] == result["removed_bytes"]
