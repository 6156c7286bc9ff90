"""Do RHO-LOSS's and OPUS's window scores still choose as whole-sequence scores do, alone and after their prefix?

    python -m bench.studies.window_scores --config configs/scale/cpu-tiny-t512.yaml \
        --pool data/debian/pool.jsonl --target data/debian/target.jsonl --val data/debian/val.jsonl \
        --out bench/results/long-shape/window-scores

The learner is the config's LitGPT trained by random selection (K uniformly drawn pool sequences a
step, the config's AdamW, warmup and cosine over its ``max_steps``) up to ``--steps`` steps. RHO-LOSS's
reference is its default: a 2 × 128 GPT pretrained for ``--reference-steps`` steps on the target split,
built as :class:`~selection_callbacks.methods.RhoLossSelection` builds it. ``--superbatches`` superbatches
of N = K/ρ pool sequences are then scored, each with one draw of 8 target rows:

- RHO-LOSS: ℓ_learner − ℓ_reference (mean token loss over the scored tokens);
- OPUS: the utility ⟨G_i, −Jᵀḡ_target⟩ through the live AdamW's step maps
  (:class:`~selection_callbacks.scoring.ghost.engine.GhostEngine` over the blocks, OPUS's default layers; the
  redundancy term left out: it acts on the draw, not on the score).

Each method scores the whole T-token rows, and seeded L-token windows (the callbacks' draws) of the
candidates and of the target rows, alone (the window is the whole context) and in context (each
window after its own prefix, the loss on the window only: ``window_context=True``). Per method, L and
context: the Spearman of window against whole-sequence scores within each superbatch (median over
superbatches), the top-K overlap |top-K(window) ∩ top-K(whole)| / K (ρ expected at random), the
tokens each scoring pass runs per candidate, and its seconds per superbatch relative to the
whole-sequence pass (the modes interleaved within every superbatch, the host's load recorded).
Writes ``<out>.json`` and ``<out>.md`` (the table, also printed).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import yaml
from jsonargparse import ArgumentParser, Namespace

from bench.studies.window_learnability import top_overlap
from models.lit_gpt import LitGPT
from selection_callbacks.core.costs import CostMeter
from selection_callbacks.core.machine_load import LoadSnapshot, describe_load, other_cpu_seconds
from selection_callbacks.core.rank_correlation import spearman
from selection_callbacks.core.rng import derived_seed, micro_batch_generator
from selection_callbacks.data.datamodule import PoolDataModule
from selection_callbacks.nn.gpt import GPTConfig
from selection_callbacks.nn.optim import build_optimizer, warmup_cosine
from selection_callbacks.scoring.ghost.engine import GhostEngine
from selection_callbacks.scoring.maps.step_maps import OptimizerStepMaps
from selection_callbacks.scoring.proxy_models import Proxy, gpt_proxy_config, pretrain_on_target, seeded_proxy
from selection_callbacks.scoring.windows import candidate_windows, score_windows

TARGET_ROWS = 8  # OPUS's default target_batch_size


def trained_learner(config: dict, dm: PoolDataModule, steps: int, seed: int) -> tuple[LitGPT, torch.optim.Optimizer]:
    """The config's LitGPT after ``steps`` steps of random selection, and its optimizer (state kept for OPUS's maps)."""
    model_args, t = dict(config["model"]), dm.seq_len
    gpt = GPTConfig(**{**model_args.pop("config"), "block_size": t})
    torch.manual_seed(seed)
    learner = LitGPT(gpt, **model_args)
    hp = learner.hparams
    opt = build_optimizer(learner.model, hp.optimizer, hp.lr, hp.weight_decay, tuple(hp.betas), hp.muon_lr,
                          hp.muon_momentum, hp.muon_weight_decay)
    schedule = warmup_cosine(hp.warmup_steps, int(config["trainer"]["max_steps"]), hp.min_lr_ratio)
    pool, k = dm.splits["pool"], dm.batch_size
    rng = np.random.default_rng(derived_seed(seed, 0, 0, "window-scores-train"))
    peak = [g["lr"] for g in opt.param_groups]
    for step in range(steps):
        for group, lr in zip(opt.param_groups, peak):
            group["lr"] = lr * schedule(step)
        opt.zero_grad(set_to_none=True)
        learner.per_sample_loss(pool.batch(rng.choice(len(pool), k, replace=False))).mean().backward()
        opt.step()
    return learner, opt


def main(argv: list[str] | None = None) -> dict:
    p = ArgumentParser(prog="python -m bench.studies.window_scores", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True, help="a scale config (configs/scale/*.yaml): model, tokenizer, T, K, ρ")
    p.add_argument("--pool", required=True)
    p.add_argument("--target", required=True)
    p.add_argument("--val", required=True, help="only to build the datamodule; never read")
    p.add_argument("--lr", type=float, default=None, help="the learner's peak learning rate (default: the config's)")
    p.add_argument("--steps", type=int, default=200, help="the learner's random-selection steps before scoring")
    p.add_argument("--windows", default="16,64,256", help="window lengths L")
    p.add_argument("--methods", default="rho,opus")
    p.add_argument("--superbatches", type=int, default=32)
    p.add_argument("--reference-steps", type=int, default=300, help="the reference's pretraining steps (RHO-LOSS's default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", required=True, help="path prefix of the .json and .md")
    a = p.parse_args(argv)
    previous = torch.get_num_threads()
    torch.set_num_threads(a.threads)  # the process's setting is restored for in-process callers (tests)
    try:
        return measure(a, argv)
    finally:
        torch.set_num_threads(previous)


def scorers(methods: list[str], learner: LitGPT, opt: torch.optim.Optimizer, reference: torch.nn.Module, n: int):
    """method → (candidate rows, target rows) → [N] scores."""
    def rho(cand, _target):
        with torch.no_grad():
            return (learner.per_sample_loss(cand) - reference.per_sample_loss(cand)).float()

    engine, maps = GhostEngine(learner.model), OptimizerStepMaps(opt)

    def opus(cand, target):
        rows = {key: torch.cat([cand[key], target[key].to(cand[key].dtype)]) for key in cand}
        return engine.score(learner.per_sample_loss, rows, n, maps).utilities.float()

    known = {"rho": rho, "opus": opus}
    unknown = [m for m in methods if m not in known]
    if unknown:
        raise SystemExit(f"--methods {unknown}: this study scores {sorted(known)}")
    return {m: known[m] for m in methods}


def measure(a: Namespace, argv: list[str] | None) -> dict:
    """The measurement of ``main``'s arguments ``argv`` parsed as ``a``: writes ``a.out``.json and .md, returns the result."""
    config = yaml.safe_load(Path(a.config).read_text())
    if a.lr is not None:
        config["model"]["lr"] = a.lr
    data = config["data"]
    dm = PoolDataModule(a.pool, a.target, a.val, seq_len=data["seq_len"], batch_size=data["batch_size"],
                        ratio=data["ratio"], seed=a.seed, tokenizer=data.get("tokenizer"), progress=False)
    dm.setup("fit")
    pool, t, n = dm.splits["pool"], dm.seq_len, dm.superbatch_size
    k, windows, methods = dm.batch_size, [int(w) for w in a.windows.split(",")], a.methods.split(",")
    learner, opt = trained_learner(config, dm, a.steps, a.seed)
    vocab = learner.config.vocab_size
    reference = seeded_proxy(gpt_proxy_config(vocab, t, 2, 128, 4), a.seed, "reference")
    pretrain_on_target(Proxy("reference", reference, CostMeter(), lr=2e-3), dm, a.reference_steps, 16, a.seed)
    score = scorers(methods, learner, opt, reference, n)
    modes = [(w, c) for w in windows for c in ((False, True) if w < t else (False,))]  # a whole row has no prefix
    rng = np.random.default_rng(derived_seed(a.seed, 0, 0, "window-scores"))
    whole: dict[str, list] = {m: [] for m in methods}
    cut: dict[tuple, list] = {(m, w, c): [] for m in methods for w, c in modes}
    seconds: dict[tuple, float] = {(m, w, c): 0.0 for m in methods for w, c in [(t, False), *modes]}
    start = LoadSnapshot.now()
    for i in range(a.superbatches):
        cand = pool.batch(rng.choice(len(pool), n, replace=False))
        cand = {key: cand[key] for key in ("input_ids", "labels")}
        target = dm.target_batch(TARGET_ROWS, np.random.default_rng(derived_seed(a.seed, 0, i, "proxy")))
        target = {key: target[key] for key in ("input_ids", "labels")}
        for m, fn in score.items():
            clock = time.perf_counter()
            whole[m].append(fn(cand, target))
            seconds[(m, t, False)] += time.perf_counter() - clock
            for w, c in modes:
                clock = time.perf_counter()
                c_rows = candidate_windows(cand, w, a.seed, 0, i, context=c)
                t_rows = score_windows(target, w, micro_batch_generator(a.seed, 0, i, "proxy-window"), context=c)
                cut[(m, w, c)].append(fn(c_rows, t_rows))
                seconds[(m, w, c)] += time.perf_counter() - clock
    end = LoadSnapshot.now()
    other = other_cpu_seconds(start, end)
    load = describe_load(None if other is None else other / max(end.wall - start.wall, 1e-9), None)
    rows = []
    for m in methods:
        for w, c in modes:
            rho = [spearman(x, y) for x, y in zip(cut[(m, w, c)], whole[m])]
            rows.append({"method": m, "window": w, "context": c, "tokens_per_candidate": t if c else min(w, t),
                         "median_spearman": statistics.median(rho), "spearman": rho,
                         "mean_top_k_overlap": statistics.mean(top_overlap(x, y, k) for x, y in zip(cut[(m, w, c)], whole[m])),
                         "seconds_vs_whole": seconds[(m, w, c)] / seconds[(m, t, False)]})
            print(f"[window_scores] {m} L={w} {'in context' if c else 'alone'}: Spearman {rows[-1]['median_spearman']:.3f}, "
                  f"top-{k} overlap {rows[-1]['mean_top_k_overlap']:.2f}", flush=True)
    result = {"args": dict(vars(a)), "T": t, "N": n, "K": k, "load": load,
              "whole_seconds_per_superbatch": {m: seconds[(m, t, False)] / a.superbatches for m in methods}, "rows": rows}
    write(result, argv, Path(a.out))
    return result


def write(result: dict, argv: list[str] | None, out: Path) -> None:
    """``out``.json (the result) and ``out``.md (the table, also printed)."""
    a, t, n, k = result["args"], result["T"], result["N"], result["K"]
    lines = [f"# Window scores against whole {t}-token sequences", "",
             f"`python -m bench.studies.window_scores {' '.join(sys.argv[1:] if argv is None else argv)}`", "",
             f"Learner after {a['steps']} random-selection steps; {a['superbatches']} superbatches of N = {n}, seed "
             f"{a['seed']}; median Spearman and mean top-{k} overlap ({k / n:.2f} at random) within superbatches. "
             f"Seconds relative to the whole-sequence pass, interleaved per superbatch; host load: {result['load']}.", "",
             "| method | window L | context | tokens per candidate | Spearman vs whole | top-K overlap | seconds × whole |",
             "|---|---:|---|---:|---:|---:|---:|"]
    lines += [f"| {r['method']} | {r['window']} | {'prefix' if r['context'] else 'alone'} | {r['tokens_per_candidate']} | "
              f"{r['median_spearman']:.3f} | {r['mean_top_k_overlap']:.2f} | {r['seconds_vs_whole']:.2f} |"
              for r in result["rows"]]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1, default=str))
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
