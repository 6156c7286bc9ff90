"""OPUS scoring memory per rank under FSDP2 against DDP: the peak of live tensor bytes inside ``score()``.

    python -m bench.studies.fsdp_memory --out bench/results/fsdp-memory

Two CPU processes (gloo) hold a GPT of ~9.9M parameters (8 layers × 320), replicated (DDP's layout: every
rank holds every parameter and AdamW moment) or FSDP2-sharded (``fully_shard`` per block, then the root:
each rank holds a row shard of each). One AdamW step on a training batch fills the moments; then the ghost
engine, configured as OPUS's default (16-token windows, a 512-bin tensor sketch, AdamW's map), scores N
candidates against P target rows, once to warm up and once under the torch profiler with ``profile_memory``.

Live tensor bytes during the profiled call = the bytes the rank held when the call started (its parameters
and AdamW moments, local shards under FSDP2, counted from the tensors) + the running sum of the profiler's
allocation and free events inside the call; the peak is the largest value of that sum. Sharding removes
(1 − 1/world) of the parameter and moment bytes from each rank; the study reports the peaks, their
difference and that difference as a share of the removed bytes. Under FSDP2 the call all-gathers each
block's weights for its forward and again for its backward, and the AdamW map gathers one layer's second
moment at a time; those transients are what keep the saving below the removed bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.profiler import ProfilerActivity, profile

from models.parallelize import shard
from selection_callbacks.nn.gpt import GPT, GPTConfig
from selection_callbacks.scoring.ghost.engine import GhostEngine
from selection_callbacks.scoring.losses import mean_token_losses
from selection_callbacks.scoring.maps.step_maps import OptimizerStepMaps

MODES = ("ddp", "fsdp2")


def local_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes a rank holds for ``tensors`` (a DTensor's local shard only)."""
    return sum((t.to_local() if isinstance(t, DTensor) else t).untyped_storage().nbytes() for t in tensors)


def peak_of(prof: profile) -> int:
    """The largest running sum of the profiler's allocation (+) and free (−) events, in time order (bytes): each
    allocator call the profiler recorded (its ``[memory]`` events, before they are attributed to operators)."""
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    running, peak = 0, 0
    for _, delta in events:
        running += delta
        peak = max(peak, running)
    return peak


def worker(rank: int, a: argparse.Namespace, port: int) -> None:
    """One rank: build, shard or replicate, one AdamW step, then the warm and the profiled scoring calls."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=a.world)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=a.layers, n_head=a.layers, n_embd=a.width, vocab_size=320, block_size=128))
    n_params = sum(p.numel() for p in model.parameters())
    if a.mode == "fsdp2":
        shard(model, model.blocks, init_device_mesh("cpu", (a.world,)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(rank)
    batch = torch.randint(0, 320, (8, 129), generator=gen)
    loss = torch.nn.functional.cross_entropy(model(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten())
    loss.backward()
    if a.mode == "ddp":  # DDP's all-reduce of the gradients, so the replicas take the same step
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= a.world
    opt.step()
    opt.zero_grad(set_to_none=True)
    windows = torch.randint(0, 320, (a.candidates + a.target_rows, a.score_len + 1), generator=gen)
    rows = {"input_ids": windows[:, :-1], "labels": windows[:, 1:]}
    engine = GhostEngine(model, sketch_dim=512)
    loss_fn = mean_token_losses(model)
    maps = OptimizerStepMaps(opt)
    engine.score(loss_fn, rows, a.candidates, maps)  # warm-up: lazily built sketches and buffers
    held = local_bytes(list(model.parameters())) + local_bytes(
        [t for state in opt.state.values() for t in state.values() if isinstance(t, torch.Tensor) and t.ndim])
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        engine.score(loss_fn, rows, a.candidates, maps)
    record = {"rank": rank, "mode": a.mode, "parameters": n_params, "held_bytes": held, "call_peak_bytes": peak_of(prof),
              "peak_live_bytes": held + peak_of(prof)}
    Path(a.out, f"{a.mode}-rank{rank}.json").write_text(json.dumps(record))
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def summarise(out: Path, world: int) -> dict[str, Any]:
    """Both modes' per-rank records, the saving and its share of the bytes sharding removes (rank-wise worst case)."""
    runs = {mode: [json.loads((out / f"{mode}-rank{r}.json").read_text()) for r in range(world)] for mode in MODES}
    ddp_peak = max(r["peak_live_bytes"] for r in runs["ddp"])
    fsdp_peak = max(r["peak_live_bytes"] for r in runs["fsdp2"])
    removed = max(r["held_bytes"] for r in runs["ddp"]) * (1 - 1 / world)
    return {"runs": runs, "ddp_peak_bytes": ddp_peak, "fsdp2_peak_bytes": fsdp_peak, "removed_bytes": removed,
            "saving_share_of_removed": (ddp_peak - fsdp_peak) / removed}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m bench.studies.fsdp_memory", description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--width", type=int, default=320)
    p.add_argument("--candidates", type=int, default=64, help="N per rank")
    p.add_argument("--target-rows", type=int, default=8, help="P target rows")
    p.add_argument("--score-len", type=int, default=16)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    for mode in MODES:
        a.mode = mode
        mp.spawn(worker, args=(a, free_port()), nprocs=a.world, join=True)
    result = summarise(Path(a.out), a.world)
    mib = 2**20
    text = (f"# OPUS scoring memory per rank: FSDP2 against DDP ({a.world} CPU processes)\n\n"
            f"GPT {a.layers} × {a.width} ({result['runs']['ddp'][0]['parameters']:,} parameters), AdamW, N = {a.candidates} "
            f"candidates + P = {a.target_rows} target rows per rank, {a.score_len}-token windows, 512-bin sketch.\n\n"
            "| mode | rank | held (params + moments) MiB | peak inside score() MiB | peak live MiB |\n|---|---:|---:|---:|---:|\n"
            + "".join(f"| {r['mode']} | {r['rank']} | {r['held_bytes'] / mib:.1f} | {r['call_peak_bytes'] / mib:.1f} | "
                      f"{r['peak_live_bytes'] / mib:.1f} |\n" for mode in MODES for r in result["runs"][mode])
            + f"\nSharding removes {result['removed_bytes'] / mib:.1f} MiB of parameters and moments per rank; the peak "
            f"falls by {(result['ddp_peak_bytes'] - result['fsdp2_peak_bytes']) / mib:.1f} MiB, "
            f"{result['saving_share_of_removed']:.0%} of it.\n")
    Path(a.out, "README.md").write_text(text)
    Path(a.out, "fsdp_memory.json").write_text(json.dumps(result, indent=1))
    print(text)
    return result


if __name__ == "__main__":
    main()
