"""Ghost engine cost: scoring time and peak memory against a naive per-sample baseline and the floor.

    python -m bench.studies.ghost --out bench/results/ghost.json

For a GPT of ~11M parameters and N = 16, 32, 64 candidates (+ a target batch), each variant runs in
its own subprocess so peak RSS only rises within it:
- ``engine``: GhostEngine, exact utilities + TensorSketch (live AdamW map), candidates
  in passes of ``--engine-chunk`` rows, the target rows with the first (activation memory flat in N);
- ``naive``: chunked ``vmap(grad)`` per-sample gradients of the scored weights, the same (exact)
  map, utilities and the same hash family applied to the formed P G_i;
- ``naive_full``: the same with all N per-sample gradients at once (no chunking): memory ∝ N;
- ``floor``: one plain forward + backward over the same tokens (parameter ``.grad``).
With ``--maps`` the engine is also timed with AdamW's sketch from P G_i formed in every layer
(``engine_formed``) and through the rescaled rank-1 factors of D in every layer (``engine_factored``; the
engine's default takes the factors where ρ ≤ ``FACTOR_TOLERANCE``), and on a Muon + AdamW optimizer
``engine_muon_momentum`` (one VJP at the momentum) and ``engine_muon_frozen`` (utilities through the
frozen Newton–Schulz map, the maps before the VJP).
On CPU, memory is the peak RSS increase of the first call over the state right before it (the
kernel's high-water mark reset through /proc/self/clear_refs; glibc's mmap threshold fixed so
freed tensors leave RSS); time, measured in a second process with the default allocator, is the
median of the warm repeats after a first call. With ``--device cuda`` memory is the peak of
``torch.cuda.max_memory_allocated`` over the allocation before the first call (exact per call, so
one process per variant serves every N), time is synchronised wall-clock, and one more call runs
under the profiler: ``cuda_ms`` (summed kernel time) against ``seconds`` says whether the call is
bound by the GPU or by launching it; the model runs under bf16 autocast there (``--dtype fp32``
to turn off).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from jsonargparse import ArgumentParser

from bench.harness.report import write_json
from selection_callbacks.nn.gpt import GPT, GPTConfig
from selection_callbacks.nn.optim import build_optimizer
from selection_callbacks.scoring.ghost.engine import FACTOR_TOLERANCE, GhostEngine
from selection_callbacks.scoring.ghost.layers import scored_layers
from selection_callbacks.scoring.losses import mean_token_losses as row_losses
from selection_callbacks.scoring.maps.base import OptimizerMap
from selection_callbacks.scoring.maps.step_maps import OptimizerStepMaps
from selection_callbacks.scoring.sketch import TensorSketch, sketch_blocks

TARGET_ROWS = 8


def _rss_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")




def setup(args: argparse.Namespace):
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=320, block_size=args.score_len, n_layer=args.layers, n_head=args.width // 64, n_embd=args.width)
    model = GPT(cfg).to(args.device)
    optimizer = "muon" if (getattr(args, "child", None) or "").startswith("engine_muon") else "adamw"
    opt = build_optimizer(model, optimizer, 3e-3, 0.1, (0.9, 0.95), 0.02, 0.95, 0.0)
    for _ in range(getattr(args, "warm_steps", 2)):  # real optimizer state from small batches (keeps the setup's memory peak low)
        ids = torch.randint(0, 256, (2, args.score_len + 1), device=args.device)
        opt.zero_grad()
        row_losses(model)({"input_ids": ids[:, :-1], "labels": ids[:, 1:]}).mean().backward()
        opt.step()
    opt.zero_grad(set_to_none=True)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 256, (args.n + TARGET_ROWS, args.score_len + 1), generator=gen).to(args.device)
    return model, opt, {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}


def prepare_engine(model, opt, rows, args) -> Callable[[], None]:
    engine = GhostEngine(model, sketch_dim=args.sketch_dim, sketch="tensor", candidate_chunk=args.engine_chunk or None)
    return lambda: engine.score(row_losses(model), rows, args.n, OptimizerStepMaps(opt))


class FrozenUtilities:
    """The optimizer's maps with utilities ⟨P G_i, ḡ⟩ through the frozen map P (the maps before the VJP)."""

    def __init__(self, opt: torch.optim.Optimizer) -> None:
        self.resolve = OptimizerStepMaps(opt)

    def group_key(self, param: torch.nn.Parameter):
        return self.resolve.group_key(param)

    def gains_from_grouping(self, param: torch.nn.Parameter) -> bool:
        return self.resolve.gains_from_grouping(param)

    def __call__(self, params, gbar: torch.Tensor) -> OptimizerMap:
        pre = self.resolve(params, gbar)
        pre.utility_vector = pre.apply
        return pre


def prepare_engine_with(resolver: Callable, factor_tolerance: float = FACTOR_TOLERANCE) -> Callable:
    """``prepare_engine`` with the resolver ``resolver(opt, args)`` (and AdamW's sketch ``factor_tolerance``)."""

    def prepare(model, opt, rows, args) -> Callable[[], None]:
        engine = GhostEngine(model, sketch_dim=args.sketch_dim, sketch="tensor", candidate_chunk=args.engine_chunk or None,
                             factor_tolerance=factor_tolerance)
        return lambda: engine.score(row_losses(model), rows, args.n, resolver(opt, args))

    return prepare


MAP_VARIANTS = {
    "engine_formed": prepare_engine_with(lambda opt, args: OptimizerStepMaps(opt), factor_tolerance=0.0),
    "engine_factored": prepare_engine_with(lambda opt, args: OptimizerStepMaps(opt), factor_tolerance=float("inf")),
    "engine_muon_momentum": prepare_engine_with(lambda opt, args: OptimizerStepMaps(opt)),
    "engine_muon_frozen": prepare_engine_with(lambda opt, args: FrozenUtilities(opt)),
}


def per_sample_weight_grads(model) -> tuple[list[str], Callable]:
    """(names, fn): the scored weights' names and ``fn(weights, ids, labels)`` → name → per-sample gradients
    [n, d_out, d_in] by ``vmap(grad)`` of each row's mean token loss (the other parameters held fixed)."""
    from torch.func import functional_call, grad, vmap

    names = [f"{n}.weight" for n, _ in scored_layers(model)]
    fixed = {k: v.detach() for k, v in model.named_parameters() if k not in names}

    def single(scored, x, y):
        return F.cross_entropy(functional_call(model, {**fixed, **scored}, (x[None],))[0], y)

    return names, vmap(grad(single), in_dims=(None, 0, 0))


def prepare_naive(model, opt, rows, args, chunk: int | None = None) -> Callable[[], None]:
    """Per-sample gradients of the scored weights by chunked vmap(grad), exact P, the same hash family."""
    chunk = chunk or args.chunk
    names, per_sample = per_sample_weight_grads(model)
    params = dict(model.named_parameters())
    hashes = {}
    blocks = sketch_blocks([params[k].numel() for k in names], args.sketch_dim)
    for i, (k, (offset, n)) in enumerate(zip(names, blocks)):  # the engine's TensorSketch hash (layer i's block)
        bins, signs = TensorSketch(args.sketch_dim, *params[k].shape, 0, [i], torch.device(args.device), n, [offset]).explicit()
        hashes[k] = (bins[0], signs[0])

    def run() -> torch.Tensor:
        """The utilities [N] (sketches are built and dropped, as the engine's would be read)."""
        scored = {k: params[k].detach() for k in names}
        target = per_sample(scored, rows["input_ids"][args.n :], rows["labels"][args.n :])
        gbar = {k: target[k].mean(0) for k in names}
        maps = {k: OptimizerStepMaps(opt)([params[k]], gbar[k][None]) for k in names}
        utilities = []
        for i in range(0, args.n, chunk):
            j = min(i + chunk, args.n)  # candidates only, never the target rows after them
            G = per_sample(scored, rows["input_ids"][i:j], rows["labels"][i:j])
            u, sketch = 0.0, torch.zeros(G[names[0]].shape[0], args.sketch_dim, device=args.device)
            for k in names:
                PG = maps[k].apply(G[k][None])[0]
                u = u + (PG * gbar[k]).flatten(1).sum(1)
                idx, sign = hashes[k]
                sketch.index_add_(1, idx, PG.flatten(1) * sign)
            utilities.append(u)
            del G
        return torch.cat(utilities)

    return run


def prepare_naive_full(model, opt, rows, args) -> Callable[[], None]:
    return prepare_naive(model, opt, rows, args, chunk=args.n)


def prepare_floor(model, opt, rows, args) -> Callable[[], None]:
    def run() -> None:
        model.zero_grad(set_to_none=True)
        row_losses(model)(rows).sum().backward()

    return run


BASE_VARIANTS = {"engine": prepare_engine, "naive": prepare_naive, "naive_full": prepare_naive_full, "floor": prepare_floor}
VARIANTS = BASE_VARIANTS | MAP_VARIANTS


def _autocast(args: argparse.Namespace):
    on = args.device == "cuda" and args.dtype == "bf16"
    return torch.autocast("cuda", dtype=torch.bfloat16, enabled=on) if args.device == "cuda" else contextlib.nullcontext()


def child(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    cuda = args.device == "cuda"
    model, opt, rows = setup(args)
    fn = VARIANTS[args.child](model, opt, rows, args)  # built outside the measurements (hash tables, engine)

    def call() -> None:
        with _autocast(args):
            fn()
        if cuda:
            torch.cuda.synchronize()

    if cuda:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    else:
        _reset_peak()
        base = _rss_kb("VmRSS")
    call()  # the first call: its peak is the memory measurement, then warm timings
    peak = (torch.cuda.max_memory_allocated() - base) / 1024.0 if cuda else _rss_kb("VmHWM") - base
    model.zero_grad(set_to_none=True)
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
    out = {"seconds": statistics.median(times), "peak_mb": peak / 1024.0, "params": sum(p.numel() for p in model.parameters())}
    if cuda:
        out |= _kernel_profile(call)
        model.zero_grad(set_to_none=True)
    return out


def _kernel_profile(call: Callable[[], None]) -> dict:
    """Summed CUDA kernel time and kernel count of one call (under the profiler)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        call()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    by_name: dict[str, float] = {}
    for e in kernels:
        by_name[e.name[:80]] = by_name.get(e.name[:80], 0.0) + e.device_time / 1000.0
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:8]
    return {"cuda_ms": sum(e.device_time for e in kernels) / 1000.0, "kernels": len(kernels), "top_kernels_ms": top}


def children(args: argparse.Namespace, ns: list[int]) -> list[dict]:
    """One variant at every N in this process (CUDA: the allocator's peak is exact per call)."""
    return [child(argparse.Namespace(**{**vars(args), "n": n})) for n in ns]


def build_parser() -> ArgumentParser:
    """The ``bench.studies.ghost`` flags (``--child`` and ``--n`` are how it runs its own timing processes)."""
    p = ArgumentParser(prog="python -m bench.studies.ghost", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=False, help="result JSON to write (default: only print it)")
    p.add_argument("--ns", default="16,32,64", help="comma-separated candidate counts N")
    p.add_argument("--layers", type=int, default=6, help="GPT blocks")
    p.add_argument("--width", type=int, default=384, help="GPT width (n_embd; one head per 64)")
    p.add_argument("--score-len", type=int, default=64, help="tokens per scored row")
    p.add_argument("--sketch-dim", type=int, default=1024, help="sketch size m of the engine and the naive baseline")
    p.add_argument("--chunk", type=int, default=8, help="naive per-sample gradient chunk")
    p.add_argument("--engine-chunk", type=int, default=16, help="engine candidates per pass (0: one pass over all rows)")
    p.add_argument("--warm-steps", type=int, default=2, help="optimizer steps on 2-row batches before scoring (the state the maps read)")
    p.add_argument("--repeats", type=int, default=3, help="timed calls per process (after a first call)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved timing processes per variant")
    p.add_argument("--threads", type=int, default=2, help="torch threads of each timing process")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the model and the scoring run")
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16", help="autocast dtype on cuda")
    p.add_argument("--maps", action="store_true", help="also time the engine with the other utility maps (AdamW ḡ² in v, Muon)")
    p.add_argument("--child", choices=list(VARIANTS), help="internal: time this one variant here and print its JSON")
    p.add_argument("--n", type=int, default=64, help="internal: the child's candidate count (CPU; CUDA covers --ns)")
    return p


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    ns = [int(x) for x in args.ns.split(",")]
    if args.child:
        print(json.dumps(children(args, ns) if args.device == "cuda" else child(args)))
        return {}
    table = []
    root = Path(__file__).resolve().parents[2]
    variants = list(VARIANTS if args.maps else BASE_VARIANTS)

    def child_run(variant: str, n: int | None, env: dict | None = None):
        cmd = [sys.executable, "-m", "bench.studies.ghost", "--child", variant, "--n", str(n or 0), "--ns", args.ns]
        for flag in ("layers", "width", "score_len", "sketch_dim", "chunk", "engine_chunk", "warm_steps", "repeats", "threads", "device", "dtype"):
            cmd += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
        done = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env, cwd=root)
        return json.loads(done.stdout.splitlines()[-1])

    if args.device == "cuda":  # one process per variant and round, covering every N
        rounds = [{v: child_run(v, None) for v in variants} for _ in range(args.rounds)]
        for i, n in enumerate(ns):
            row = {"n": n, "params": rounds[0]["floor"][i]["params"]}
            for variant in variants:
                results = [r[variant][i] for r in rounds]
                row[f"{variant}_seconds"] = statistics.median(r["seconds"] for r in results)
                row[f"{variant}_rounds"] = [r["seconds"] for r in results]
                row[f"{variant}_peak_mb"] = results[0]["peak_mb"]
                row[f"{variant}_cuda_ms"], row[f"{variant}_kernels"] = results[0]["cuda_ms"], results[0]["kernels"]
                row[f"{variant}_top_kernels_ms"] = results[0]["top_kernels_ms"]
                print(f"[ghost] N={n} {variant}: {row[f'{variant}_seconds']:.4f}s, kernels {row[f'{variant}_kernels']} "
                      f"({row[f'{variant}_cuda_ms']:.2f} ms on the GPU), peak +{row[f'{variant}_peak_mb']:.0f} MB", flush=True)
            table.append(row)
    for n in ns if args.device != "cuda" else []:
        # time: --rounds interleaved rounds of one process per variant (default allocator), the median
        # over rounds, so a slow spell on a shared machine hits every variant alike. Memory (CPU): one
        # more process per variant whose fixed mmap threshold returns freed tensors to the OS, so RSS
        # tracks live memory (that setting would slow the timed runs); on CUDA the first round's peak.
        runs: dict[str, list[dict]] = {v: [] for v in variants}
        for _ in range(args.rounds):
            for variant in variants:
                runs[variant].append(child_run(variant, n))
        row: dict = {"n": n, "params": runs["floor"][0]["params"]}
        for variant, results in runs.items():
            seconds = [r["seconds"] for r in results]
            mem = results[0] if args.device == "cuda" else child_run(variant, n, {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"})
            row[f"{variant}_seconds"], row[f"{variant}_peak_mb"] = statistics.median(seconds), mem["peak_mb"]
            row[f"{variant}_rounds"] = seconds
            print(f"[ghost] N={n} {variant}: {row[f'{variant}_seconds']:.3f}s (rounds {', '.join(f'{t:.3f}' for t in seconds)}), "
                  f"peak +{mem['peak_mb']:.0f} MB", flush=True)
        table.append(row)
    last = table[-1]
    result = {
        "config": {k: getattr(args, k) for k in ("layers", "width", "score_len", "sketch_dim", "chunk", "engine_chunk", "warm_steps", "repeats", "rounds", "threads")}
        | {"target_rows": TARGET_ROWS, "params": last["params"], "device": args.device,
           "dtype": args.dtype if args.device == "cuda" else "fp32"},
        "n": last["n"],
        "speedup_vs_naive": last["naive_seconds"] / last["engine_seconds"],
        "ratio_to_floor": last["engine_seconds"] / last["floor_seconds"],
        "peak_mem_ratio_to_floor": last["engine_peak_mb"] / last["floor_peak_mb"],
        "naive_mem_growth": table[-1]["naive_peak_mb"] / table[0]["naive_peak_mb"],
        "naive_full_mem_growth": table[-1]["naive_full_peak_mb"] / table[0]["naive_full_peak_mb"],
        "engine_mem_growth": table[-1]["engine_peak_mb"] / table[0]["engine_peak_mb"],
        "floor_mem_growth": table[-1]["floor_peak_mb"] / table[0]["floor_peak_mb"],
        "per_n": table,
    }
    print(json.dumps({k: v for k, v in result.items() if k != "per_n"}, indent=1))
    write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
