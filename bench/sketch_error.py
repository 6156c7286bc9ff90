"""Tensor-sketch error by layout: the engine's per-layer blocks (sized by weight count) against even blocks and
against every layer over all m bins.

    python -m bench.sketch_error --out bench/results/ghost/sketch-error.json

On the bench.ghost GPT (live AdamW map, applied exactly to materialised per-sample gradients P G_i of
every scored weight), every layout hashes each layer's P G_i with TensorSketch's own hash: entry
(o, i) to (h1(o) + h2(i)) mod n with sign s1(o)s2(i), into the layer's block of n bins
(``sketch_blocks``: n ∝ d_out·d_in; ``even``: n = m // layers) or over all m bins (``shared``).
Reported per m: the mean over candidate pairs and seeds of |⟨S_i, S_j⟩ − ⟨P G_i, P G_j⟩| /
(‖P G_i‖‖P G_j‖), and, once, the largest layer's share of Σ_l ‖P G_i^l‖².
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from jsonargparse import ArgumentParser

from bench.ghost import per_sample_weight_grads, setup
from bench.report import write_json
from selection_callbacks.scoring.preconditioners import OptimizerPreconditioner
from selection_callbacks.scoring.sketch import TensorSketch, sketch_blocks


def preconditioned_grads(model, opt, rows, n: int) -> dict[str, torch.Tensor]:
    """name → P G_i [n, d_out, d_in] of every scored weight (ḡ from the proxy rows after the n candidates)."""
    names, per_sample = per_sample_weight_grads(model)
    params = dict(model.named_parameters())
    G = per_sample({k: params[k].detach() for k in names}, rows["input_ids"], rows["labels"])
    resolve = OptimizerPreconditioner(opt)
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


def build_parser() -> ArgumentParser:
    """The ``bench.sketch_error`` flags."""
    p = ArgumentParser(prog="python -m bench.sketch_error", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, help="result JSON to write (default: only return it)")
    p.add_argument("--n", type=int, default=8, help="candidates")
    p.add_argument("--ms", default="256,512,1024", help="comma-separated sketch sizes m")
    p.add_argument("--seeds", type=int, default=20, help="hash seeds per sketch size")
    p.add_argument("--layers", type=int, default=6, help="GPT blocks")
    p.add_argument("--width", type=int, default=384, help="GPT width (n_embd; one head per 64)")
    p.add_argument("--score-len", type=int, default=16, help="tokens per scored row")
    return p


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    model, opt, rows = setup(argparse.Namespace(**vars(args), device="cpu"))
    PG = preconditioned_grads(model, opt, rows, args.n)
    flat = torch.cat([g.flatten(1) for g in PG.values()], 1)
    exact = flat @ flat.T
    norms = exact.diagonal().sqrt()
    iu = torch.triu_indices(args.n, args.n, 1)
    shares = torch.stack([g.flatten(1).square().sum(1) for g in PG.values()]) / exact.diagonal()
    result = {"config": vars(args) | {"out": str(args.out), "layers_scored": len(PG), "proxy_rows": rows["input_ids"].shape[0] - args.n},
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
    write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
