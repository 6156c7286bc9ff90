"""Does RHO-LOSS's ranking survive scoring a window instead of the whole sequence?

    python -m bench.studies.window_learnability --pool data/default/pool.jsonl --target data/default/target.jsonl \
        --val data/default/val.jsonl --out bench/results/steptime/window-learnability

A learner (cpu-tiny's GPT trained on uniformly drawn pool sequences, AdamW at lr 3e-3 with the
tuned 200-step warmup and no decay: an approximation of random selection's learner) and a
reference (RHO-LOSS's default: a 2 × 128 GPT
pretrained for 300 steps on the target split, built as :class:`~selection_callbacks.methods.RhoLossSelection`
builds it) score ``--superbatches`` superbatches of N = 32 pool sequences at each of ``--steps``.
Learnability is ℓ_learner − ℓ_reference (mean token loss): over the whole T-token sequence, and
over a seeded random window of L tokens (the window alone is the model's context, as windowed
scoring would run). Per L: the Spearman of window against full-sequence learnability within each
superbatch (median over superbatches) and the top-K overlap |top-K(window) ∩ top-K(full)| / K at
K = 16 (0.5 expected at random). A window's forward costs L/T of the full one's (attention
aside). Writes ``<out>.json`` and ``<out>.md`` (the table, also printed).
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import numpy as np
import torch
from jsonargparse import ArgumentParser, Namespace

from selection_callbacks.core.costs import CostMeter
from selection_callbacks.core.rank_correlation import spearman
from selection_callbacks.core.rng import derived_seed
from selection_callbacks.data.datamodule import PoolDataModule
from selection_callbacks.nn.gpt import GPT, GPTConfig
from selection_callbacks.scoring.losses import mean_token_losses, per_sample_loss
from selection_callbacks.scoring.proxy_models import Proxy, pretrain_on_target, seeded_proxy
from selection_callbacks.scoring.windows import candidate_windows

N, K = 32, 16


def learner_losses(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        return mean_token_losses(model)(batch).float()


def reference_losses(reference: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        return per_sample_loss(reference, batch).float()


def top_overlap(a: torch.Tensor, b: torch.Tensor, k: int = K) -> float:
    return len(set(a.topk(k).indices.tolist()) & set(b.topk(k).indices.tolist())) / k


def main(argv: list[str] | None = None) -> dict:
    p = ArgumentParser(prog="python -m bench.studies.window_learnability", description=__doc__.split("\n\n")[0])
    p.add_argument("--pool", required=True)
    p.add_argument("--target", required=True)
    p.add_argument("--val", required=True, help="only to build the datamodule; never read")
    p.add_argument("--steps", default="100,500,1000", help="learner steps at which to score")
    p.add_argument("--windows", default="16,32,64", help="window lengths L")
    p.add_argument("--superbatches", type=int, default=64)
    p.add_argument("--reference-steps", type=int, default=300, help="the reference's pretraining steps (RHO-LOSS's default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="path prefix of the .json and .md")
    a = p.parse_args(argv)
    previous = torch.get_num_threads()
    torch.set_num_threads(1)  # the process's setting is restored for in-process callers (tests)
    try:
        return measure(a, argv)
    finally:
        torch.set_num_threads(previous)


def measure(a: Namespace, argv: list[str] | None) -> dict:
    """The measurement of ``main``'s arguments ``argv`` parsed as ``a``: writes ``a.out``.json and .md, returns the result."""
    steps, windows = [int(s) for s in a.steps.split(",")], [int(w) for w in a.windows.split(",")]
    dm = PoolDataModule(a.pool, a.target, a.val, seq_len=128, batch_size=16, ratio=0.5, seed=a.seed, progress=False)
    dm.setup("fit")
    pool, T = dm.splits["pool"], 128
    torch.manual_seed(a.seed)
    config = GPTConfig(vocab_size=320, block_size=T, n_layer=4, n_head=4, n_embd=128)
    learner = GPT(config)
    opt = torch.optim.AdamW(learner.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.0)
    reference = seeded_proxy(GPTConfig(vocab_size=320, block_size=T, n_layer=2, n_head=4, n_embd=128), a.seed, "reference")
    proxy = Proxy("reference", reference, CostMeter(), lr=2e-3)
    pretrain_on_target(proxy, dm, a.reference_steps, 16, a.seed)
    rng = np.random.default_rng(derived_seed(a.seed, 0, 0, "window-learnability"))
    probe = [rng.choice(len(pool), N, replace=False) for _ in range(a.superbatches)]
    rows, done = [], 0
    for step in steps:
        while done < step:  # random selection's training: K uniformly drawn pool sequences a step, warmup 200
            lr_scale = min(1.0, (done + 1) / 200)
            for group in opt.param_groups:
                group["lr"] = 3e-3 * lr_scale
            batch = pool.batch(rng.choice(len(pool), 16, replace=False))
            opt.zero_grad(set_to_none=True)
            mean_token_losses(learner)(batch).mean().backward()
            torch.nn.utils.clip_grad_norm_(learner.parameters(), 1.0)
            opt.step()
            done += 1
        learner.eval()
        full, cut = [], {w: [] for w in windows}
        for i, ids in enumerate(probe):
            batch = pool.batch(ids)
            full.append(learner_losses(learner, batch) - reference_losses(reference, batch))
            for w in windows:
                part = candidate_windows(batch, w, a.seed, 0, i)
                cut[w].append(learner_losses(learner, part) - reference_losses(reference, part))
        learner.train()
        for w in windows:
            rho = [spearman(c, f) for c, f in zip(cut[w], full)]
            overlap = [top_overlap(c, f) for c, f in zip(cut[w], full)]
            rows.append({"step": step, "window": w, "median_spearman": statistics.median(rho),
                         "mean_top_k_overlap": statistics.mean(overlap), "forward_cost": w / T})
            print(f"[window_learnability] step {step} L={w}: Spearman {rows[-1]['median_spearman']:.3f}, "
                  f"top-{K} overlap {rows[-1]['mean_top_k_overlap']:.2f}", flush=True)
    lines = [f"# RHO-LOSS learnability on windows against whole {T}-token sequences", "",
             f"`python -m bench.studies.window_learnability {' '.join(sys.argv[1:] if argv is None else argv)}`", "",
             f"{a.superbatches} superbatches of N = {N}, seed {a.seed}; median Spearman and mean top-{K} overlap "
             "(0.5 at random) within superbatches.", "",
             "| learner step | window L | forward cost (L/T) | Spearman vs full | top-K overlap |", "|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['step']} | {r['window']} | {r['forward_cost']:.3f} | {r['median_spearman']:.3f} | "
              f"{r['mean_top_k_overlap']:.2f} |" for r in rows]
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {"args": {k: v for k, v in vars(a).items()}, "rows": rows}
    out.with_suffix(".json").write_text(json.dumps(result, indent=1, default=str))
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return result


if __name__ == "__main__":
    main()
