"""Sketch error against the exact preconditioned Gram: over training stages and optimizers, and by block layout.

    python -m bench.studies.sketch_error --out bench/results/ghost/sketch-error-stages.json
    python -m bench.studies.sketch_error --mode layouts --out bench/results/ghost/sketch-error.json

``--mode stages`` (the default): a small GPT (output head scored) trained on a Zipf bigram token stream
with torch's AdamW (β₂ per ``--beta2s``) or Muon + AdamW, stopped at each of ``--steps``. At each state,
N candidates and a target batch; the exact Gram K_ij = Σ_layers ⟨P G_i, P G_j⟩ from per-sample gradients
(``vmap(grad)``) and the live maps (AdamW's D; Muon's Newton–Schulz frozen at the momentum, the map the
sketches use). Every engine sketch variant is scored over ``--seeds`` hash seeds:

- ``count``: the exact-chunked CountSketch of the formed P G_i (the reference);
- ``tensor``: the engine's default tensor sketch (AdamW layer groups through the rescaled rank-1 D ≈ κ r cᵀ where
  ρ ≤ ``FACTOR_TOLERANCE``, from the formed P G_i elsewhere; exact factors for the other maps);
- ``formed``: the tensor sketch from the formed P G_i in every AdamW layer (``factor_tolerance`` = 0);
- ``factored``: the tensor sketch through AdamW's κ r cᵀ everywhere (``factor_tolerance`` = ∞).

With e_ij = (⟨S_i, S_j⟩ − K_ij)/√(K_ii K_jj): ``abs_error`` the mean over pairs i < j and seeds of
|e_ij|, ``signed`` the mean of e_ij with its standard error over seeds, ``sq_norm_bias`` the mean
‖S_i‖²/K_ii − 1, ``probe`` the engine's own ``sketch_error["gram"]`` on 8 candidates (seed 0), ``ms`` the
median scoring time. Per state also the AdamW layers' mean ρ (``relative_factor_error``) and
Frobenius ``factor_error``.

``--mode layouts``: the tensor-sketch hash by block layout on the bench.studies.ghost GPT (live AdamW map applied
exactly to formed P G_i): every layout hashes each layer's P G_i with TensorSketch's own hash into
the layer's block of n bins (``sketch_blocks``: n ∝ d_out·d_in; ``even``: n = m // layers) or over all m
bins (``shared``); per m the mean pair error and, once, the largest layer's share of Σ_l ‖P G_i^l‖².
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from jsonargparse import ArgumentParser
from torch.func import functional_call, grad, vmap

from bench.harness.report import write_json
from bench.studies.ghost import per_sample_weight_grads, setup
from selection_callbacks.nn.gpt import GPT, GPTConfig
from selection_callbacks.nn.optim import build_optimizer
from selection_callbacks.scoring.ghost.engine import GhostEngine
from selection_callbacks.scoring.losses import mean_token_losses as row_losses
from selection_callbacks.scoring.maps.step_maps import OptimizerStepMaps
from selection_callbacks.scoring.sketch import TensorSketch, sketch_blocks

VOCAB, SEEN = 320, 256  # ids ≥ SEEN never occur (the byte model's unused rows)


def preconditioned_grads(model, opt, rows, n: int) -> dict[str, torch.Tensor]:
    """name → P G_i [n, d_out, d_in] of every scored weight (ḡ from the target rows after the n candidates)."""
    names, per_sample = per_sample_weight_grads(model)
    params = dict(model.named_parameters())
    G = per_sample({k: params[k].detach() for k in names}, rows["input_ids"], rows["labels"])
    resolve = OptimizerStepMaps(opt)
    return {k: resolve([params[k]], G[k][n:].mean(0)[None]).apply(G[k][None, :n])[0] for k in names}


def sketch(PG: dict[str, torch.Tensor], m: int, seed: int, layout: str) -> torch.Tensor:
    """[n, m]: Σ_layers the CountSketch of P G_i under the layer's TensorSketch hash, blocks per ``layout``."""
    out = torch.zeros(next(iter(PG.values())).shape[0], m)
    blocks = {"blocks": sketch_blocks([g[0].numel() for g in PG.values()], m),
              "even": [(i * (m // len(PG)), m // len(PG)) for i in range(len(PG))],
              "shared": [(0, None)] * len(PG)}[layout]
    for index, (g, (offset, n)) in enumerate(zip(PG.values(), blocks)):
        bins, signs = TensorSketch(m, *g.shape[1:], seed, [index], torch.device("cpu"), n, [offset]).explicit()
        out.index_add_(1, bins[0], g.flatten(1) * signs[0])
    return out


class TokenStream:
    """Zipf bigram tokens: x_{t+1} = (a·x_t + z) mod SEEN with z ~ Zipf(1.1) over SEEN ids (a skewed, learnable stream)."""

    def __init__(self, seed: int) -> None:
        self.gen = torch.Generator().manual_seed(seed)
        self.p = 1.0 / torch.arange(1, SEEN + 1, dtype=torch.float64) ** 1.1

    def rows(self, n: int, length: int) -> dict[str, torch.Tensor]:
        z = torch.multinomial(self.p.expand(n, -1), length, replacement=True, generator=self.gen)
        x = torch.empty(n, length + 1, dtype=torch.long)
        x[:, 0] = torch.randint(0, SEEN, (n,), generator=self.gen)
        for t in range(length):
            x[:, t + 1] = (37 * x[:, t] + z[:, t]) % SEEN
        return {"input_ids": x[:, :-1], "labels": x[:, 1:]}


def exact_gram(model, opt, layers: list[str], batch: dict, n: int) -> torch.Tensor:
    """[n, n] Σ_layers ⟨P G_i, P G_j⟩ from per-sample gradients of the layers' weights and the live maps."""
    params = {k: v.detach() for k, v in model.named_parameters()}

    def single(p, x, y):
        return F.cross_entropy(functional_call(model, p, (x[None],))[0], y)

    G = vmap(grad(single), in_dims=(None, 0, 0))(params, batch["input_ids"], batch["labels"])
    resolve, live = OptimizerStepMaps(opt), dict(model.named_parameters())
    gram = torch.zeros(n, n)
    for name in layers:
        g = G[f"{name}.weight"]
        PG = resolve([live[f"{name}.weight"]], g[n:].mean(0)[None]).apply(g[None, :n])[0].flatten(1)
        gram += PG @ PG.T
    return gram


def score_variant(engine: GhostEngine, model, opt, batch: dict, n: int, gram: torch.Tensor, seeds: int) -> dict:
    """The errors of ``engine``'s sketches against ``gram`` over ``seeds`` hash seeds (see the module docstring)."""
    norms = gram.diagonal().sqrt()
    iu = torch.triu_indices(n, n, 1)
    absolute, signed, bias, ms = [], [], [], []
    for seed in range(seeds):
        start = time.perf_counter()
        S = engine.score(row_losses(model), batch, n, OptimizerStepMaps(opt), seed=seed).sketches
        ms.append(1e3 * (time.perf_counter() - start))
        K = S @ S.T
        e = ((K - gram) / torch.outer(norms, norms))[iu[0], iu[1]]
        absolute.append(float(e.abs().mean()))
        signed.append(float(e.mean()))
        bias.append(float((K.diagonal() / gram.diagonal() - 1).mean()))
    probe = engine.score(row_losses(model), batch, n, OptimizerStepMaps(opt), seed=0, probe=8)
    return {"abs_error": statistics.mean(absolute), "signed": statistics.mean(signed),
            "signed_se": statistics.stdev(signed) / math.sqrt(seeds), "sq_norm_bias": statistics.mean(bias),
            "probe": float(probe.sketch_error["gram"]), "ms": statistics.median(ms), "factored_layers": len(probe.factored)}


def stages(args) -> dict:
    """Every (optimizer, step) state: the variants' errors (see the module docstring)."""
    runs = [("adamw", b2) for b2 in (float(x) for x in args.beta2s.split(","))] + ([("muon", 0.95)] if args.muon else [])
    steps = sorted(int(x) for x in args.steps.split(","))
    result = {"config": vars(args) | {"out": str(args.out)}, "states": []}
    for optimizer, beta2 in runs:
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=VOCAB, block_size=args.score_len, n_layer=args.layers, n_head=max(1, args.width // 64), n_embd=args.width))
        opt = build_optimizer(model, optimizer, 3e-3, 0.1, (0.9, beta2), 0.02, 0.95, 0.0)
        data = TokenStream(1)
        engines = {"count": GhostEngine(model, include_head=args.head, sketch_dim=args.m, sketch="count"),
                   "tensor": GhostEngine(model, include_head=args.head, sketch_dim=args.m),
                   "formed": GhostEngine(model, include_head=args.head, sketch_dim=args.m, factor_tolerance=0.0),
                   "factored": GhostEngine(model, include_head=args.head, sketch_dim=args.m, factor_tolerance=math.inf)}
        layers = [name for name, _ in engines["count"].layers]
        for step in range(1, steps[-1] + 1):
            opt.zero_grad()
            row_losses(model)(data.rows(args.train_batch, args.score_len)).mean().backward()
            opt.step()
            if step not in steps:
                continue
            opt.zero_grad(set_to_none=True)
            batch = data.rows(args.n + args.target_rows, args.score_len)
            gram = exact_gram(model, opt, layers, batch, args.n)
            probe = engines["tensor"].score(row_losses(model), batch, args.n, OptimizerStepMaps(opt), probe=2)
            row = {"optimizer": optimizer, "beta2": beta2, "step": step,
                   "rho": statistics.mean(float(v) for v in probe.relative_factor_error.values()) if probe.relative_factor_error else None,
                   "factor_error": statistics.mean(float(v) for v in probe.factor_error.values()) if probe.factor_error else None}
            for kind, engine in engines.items():
                if kind not in ("factored", "formed") or probe.factor_error:  # factors differ from the tensor sketch only with AdamW layers
                    row[kind] = score_variant(engine, model, opt, batch, args.n, gram, args.seeds)
            print(json.dumps(row), flush=True)
            result["states"].append(row)
    return result


def markdown(result: dict) -> str:
    """The stages table: one row per state and variant."""
    lines = ["| optimizer | β₂ | step | ρ (AdamW layers) | Frobenius factor error | variant | mean abs pair error | × count | "
             "signed ± s.e. | ‖S‖²/‖PG‖² − 1 | probe (engine) | ms/call | factored layers |", "|" + "---|" * 13]
    for row in result["states"]:
        ref = row["count"]["abs_error"]
        for kind in ("count", "tensor", "formed", "factored"):
            if kind not in row:
                continue
            v = row[kind]
            rho = "–" if row["rho"] is None else f"{row['rho']:.3f}"
            fe = "–" if row["factor_error"] is None else f"{row['factor_error']:.3f}"
            lines.append(f"| {row['optimizer']} | {row['beta2']} | {row['step']} | {rho} | {fe} | {kind} | {v['abs_error']:.4f} | "
                         f"{v['abs_error'] / ref:.2f} | {v['signed']:+.4f} ± {v['signed_se']:.4f} | {v['sq_norm_bias']:+.3f} | "
                         f"{v['probe']:.4f} | {v['ms']:.0f} | {v['factored_layers']} |")
    return "\n".join(lines) + "\n"


def layouts(args) -> dict:
    """The tensor-sketch hash by block layout (see the module docstring)."""
    model, opt, rows = setup(argparse.Namespace(**vars(args), device="cpu"))
    PG = preconditioned_grads(model, opt, rows, args.n)
    flat = torch.cat([g.flatten(1) for g in PG.values()], 1)
    exact = flat @ flat.T
    norms = exact.diagonal().sqrt()
    iu = torch.triu_indices(args.n, args.n, 1)
    shares = torch.stack([g.flatten(1).square().sum(1) for g in PG.values()]) / exact.diagonal()
    target_rows = rows["input_ids"].shape[0] - args.n
    result = {"config": vars(args) | {"out": str(args.out), "layers_scored": len(PG), "target_rows": target_rows},
              "largest_layer_share": float(shares.max(0).values.mean()), "per_m": []}
    for m in (int(x) for x in args.ms.split(",")):
        row: dict = {"m": m}
        for layout in ("blocks", "even", "shared"):
            errors = []
            for seed in range(args.seeds):
                s = sketch(PG, m, seed, layout)
                rel = ((s @ s.T - exact).abs() / torch.outer(norms, norms))[iu[0], iu[1]]
                errors.append(float(rel.mean()))
            row[f"{layout}_rel_error"] = sum(errors) / len(errors)
        row["blocks_over_shared"] = row["blocks_rel_error"] / row["shared_rel_error"]
        row["even_over_shared"] = row["even_rel_error"] / row["shared_rel_error"]
        print(json.dumps(row), flush=True)
        result["per_m"].append(row)
    return result


def build_parser() -> ArgumentParser:
    """The ``bench.studies.sketch_error`` flags."""
    p = ArgumentParser(prog="python -m bench.studies.sketch_error", description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=["stages", "layouts"], default="stages", help="training stages, or block layouts")
    p.add_argument("--out", type=Path, help="result JSON to write (default: only return it); stages also write a .md table beside it")
    p.add_argument("--n", type=int, default=16, help="candidates")
    p.add_argument("--seeds", type=int, default=8, help="hash seeds")
    p.add_argument("--layers", type=int, default=2, help="GPT blocks (layouts: 6)")
    p.add_argument("--width", type=int, default=128, help="GPT width (n_embd; one head per 64; layouts: 384)")
    p.add_argument("--score-len", type=int, default=16, help="tokens per scored row")
    p.add_argument("--steps", default="5,50,300", help="stages: comma-separated training steps")
    p.add_argument("--beta2s", default="0.95,0.999", help="stages: AdamW β₂ values")
    p.add_argument("--muon", type=bool, default=True, help="stages: also Muon (+ AdamW on the head)")
    p.add_argument("--head", type=bool, default=True, help="stages: score the output head")
    p.add_argument("--m", type=int, default=1024, help="stages: sketch dimension")
    p.add_argument("--target-rows", type=int, default=8, help="stages: target rows")
    p.add_argument("--train-batch", type=int, default=8, help="stages: rows per training step")
    p.add_argument("--ms", default="256,512,1024", help="layouts: comma-separated sketch sizes m")
    return p


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    if args.mode == "layouts":
        result = layouts(args)
    else:
        result = stages(args)
        if args.out is not None:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.with_suffix(".md").write_text(markdown(result))
    write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
