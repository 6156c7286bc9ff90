"""OPUS utilities against the step torch really takes, over training stages, AdamW's β₂ and Muon.

    python -m bench.studies.utility_ranking --out bench/results/ghost/utility-ranking

A tiny GPT (1 block, width 32, 16-token rows, byte vocabulary) trains on the test suite's deterministic
prose-and-noise documents (``tests/support/toy_corpus.py``, so the states are those of
tests/scoring/test_maps.py) under a real torch optimizer: AdamW with β = (0.9, β₂) per ``--beta2s``, and
Muon on the hidden matrices with AdamW (β₂ = 0.95) on the rest. At each of ``--steps`` and for every
seed of ``--seeds``, a base batch of K = 16 rows, N = 32 candidates and 8 target rows from the target
prose. The reference is each candidate's real marginal effect on one step: with ḡ_B the base batch's
mean gradient, g_i the candidate's and ḡ_target the target rows',

    effect_i = −⟨Δθ(K/(K+1)·ḡ_B + g_i/(K+1)) − Δθ(K/(K+1)·ḡ_B), ḡ_target⟩,

Δθ(g) the parameter change of one step of a float64 copy of the optimizer (state restored after each
step) fed gradient g, summed over the parameters the engine scores (every weight but the position
table). Torch's Muon iterates Newton–Schulz in bfloat16, whose rounding swamps one candidate's share;
the copy runs the same coefficients and steps in float64 (``bf16_error``: its relative Frobenius
distance from torch's own step, the largest over Muon's matrices).

Each map variant's GhostEngine utilities ⟨G_i, −Jᵀḡ_target⟩ (the OPUSSelection maps at
K rows) are scored against the effects by Spearman's ρ and by the top-K overlap
|top-16 by utility ∩ top-16 by effect| (8 expected at random). AdamW: ``frozen`` (the derivative at
torch's v). Muon: ``momentum`` (the Newton–Schulz derivative at the momentum) and ``frozen_ns`` (the
self-adjoint map, Newton–Schulz frozen at the momentum);
``at_base_batch`` is the derivative at the point the reference step really orthogonalises
(μ²·buf + (1 − μ²)·K/(K+1)·ḡ_B), which needs the base batch no scorer sees: the ceiling of any
evaluation point.
Writes ``<out>.json`` (every state and the medians) and ``<out>.md`` (the table, also printed).
"""

from __future__ import annotations

import copy
import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import numpy as np
import torch
import torch.nn.functional as F
import torch.optim._muon as torch_muon
from jsonargparse import ArgumentParser
from scipy.stats import spearmanr
from torch.func import functional_call, grad, vmap

from bench.harness.report import write_json
from selection_callbacks.data.tokenizer import ByteTokenizer
from selection_callbacks.methods import OPUSSelection
from selection_callbacks.nn.gpt import GPT, GPTConfig
from selection_callbacks.nn.optim import build_optimizer
from selection_callbacks.scoring.ghost.engine import GhostEngine
from selection_callbacks.scoring.losses import mean_token_losses as row_losses
from selection_callbacks.scoring.maps.muon import MuonMap, NewtonSchulz
from selection_callbacks.scoring.maps.step_maps import OptimizerStepMaps
from tests.support.toy_corpus import make_docs

T = 16
CFG = GPTConfig(vocab_size=320, block_size=T, n_layer=1, n_head=2, n_embd=32)
K, N_CAND, N_TARGET, TRAIN_BATCH = 16, 32, 8, 8
LR, WD, BETA1, BETA2, MUON_LR, MUON_MU = 3e-3, 0.1, 0.9, 0.95, 0.02, 0.95
NS = NewtonSchulz((torch_muon.DEFAULT_A, torch_muon.DEFAULT_B, torch_muon.DEFAULT_C), torch_muon.DEFAULT_NS_STEPS, torch_muon.EPS)
VARIANTS = {"adamw": ("frozen",), "muon": ("momentum", "frozen_ns", "at_base_batch")}

StepMaps = Callable[..., object]


def stream(docs: list[dict]) -> torch.Tensor:
    """[tokens] the byte-tokenised documents, concatenated."""
    tok = ByteTokenizer()
    return torch.from_numpy(np.concatenate([tok.encode_document(d["text"]) for d in docs]).astype(np.int64))


POOL = stream(make_docs("p", 240, 0))  # prose and printable noise
TARGET = stream(make_docs("t", 40, 1, ("prose",)))


def windows(ids: torch.Tensor, n: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """n random T-token rows of ``ids``: input_ids and labels [n, T] (labels shifted by one)."""
    starts = torch.randint(0, ids.numel() - T - 1, (n,), generator=gen)
    rows = torch.stack([ids[s : s + T + 1] for s in starts.tolist()])
    return {"input_ids": rows[:, :-1], "labels": rows[:, 1:]}


def cat(*batches: dict) -> dict:
    """The batches' rows, concatenated in order."""
    return {k: torch.cat([b[k] for b in batches]) for k in batches[0]}


def make_optimizer(model: torch.nn.Module, name: str, beta2: float = BETA2) -> torch.optim.Optimizer:
    """AdamW (β = (0.9, beta2)) over everything, or Muon + AdamW (``name == "muon"``)."""
    return build_optimizer(model, name, LR, WD, (BETA1, beta2), MUON_LR, MUON_MU, 0.0)


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, gen: torch.Generator) -> None:
    """One optimizer step on the mean token loss of TRAIN_BATCH pool rows."""
    opt.zero_grad()
    row_losses(model)(windows(POOL, TRAIN_BATCH, gen)).mean().backward()
    opt.step()


def per_sample_grads(model: torch.nn.Module, batch: dict) -> dict[str, torch.Tensor]:
    """name → [rows, *param.shape] each row's gradient of its mean token loss."""
    params = {k: v.detach() for k, v in model.named_parameters()}

    def single(p, x, y):
        return F.cross_entropy(functional_call(model, p, (x[None],))[0], y)

    return vmap(grad(single), in_dims=(None, 0, 0))(params, batch["input_ids"], batch["labels"])


def ns64(g: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float) -> torch.Tensor:
    """Torch's Newton–Schulz steps with its coefficients, in float64 (the reference's Muon)."""
    a, b, c = coefficients
    tall = g.shape[-2] > g.shape[-1]
    X = (g.mT if tall else g).double()
    X = X / torch.linalg.matrix_norm(X).clamp(min=eps)[..., None, None]
    for _ in range(steps):
        A = X @ X.mT
        X = a * X + (b * A + c * A @ A) @ X
    return X.mT if tall else X


class RealStep:
    """Δθ(g) of one step of a float64 copy of ``opt`` (state restored after every step)."""

    def __init__(self, model: torch.nn.Module, opt: torch.optim.Optimizer, name: str, beta2: float = BETA2) -> None:
        self.model = copy.deepcopy(model).double()
        self.opt = make_optimizer(self.model, name, beta2)
        self.opt.load_state_dict(opt.state_dict())
        self.state = copy.deepcopy(self.opt.state_dict())
        self.params = dict(self.model.named_parameters())
        self.theta = {k: p.detach().clone() for k, p in self.params.items()}

    @torch.no_grad()
    def __call__(self, g: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        self.opt.load_state_dict(copy.deepcopy(self.state))  # load_state_dict keeps float64 tensors, which step mutates
        for k, p in self.params.items():
            p.grad = g[k].clone()
        self.opt.step()
        delta = {k: p - self.theta[k] for k, p in self.params.items()}
        for k, p in self.params.items():
            p.copy_(self.theta[k])
            p.grad = None
        return delta


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    """‖a − b‖ / ‖b‖ (Frobenius)."""
    return float((a - b).norm() / b.norm())


class _AroundStepMaps:
    """The optimizer's step maps (``self.inner``), grouped as the engine's own; subclasses change the maps."""

    def group_key(self, param):
        return self.inner.group_key(param)

    def gains_from_grouping(self, param):
        return self.inner.gains_from_grouping(param)


class AtBaseBatch(_AroundStepMaps):
    """Muon's derivative at the point the protocol's step really orthogonalises, μ²·buf + (1 − μ²)·g
    with g = K/(K+1)·ḡ_B: the engine's VJP fed the base batch it cannot see when it scores (a
    ceiling for any evaluation point, not a map OPUS can use)."""

    def __init__(self, opt: torch.optim.Optimizer, model: torch.nn.Module, g_base: dict[str, torch.Tensor]) -> None:
        self.inner = OptimizerStepMaps(opt)
        self.muon = opt.muon
        self.names = {id(p): k for k, p in model.named_parameters()}
        self.g_base = g_base

    def __call__(self, params, gbar):
        pre = self.inner(params, gbar)
        if isinstance(pre, MuonMap):  # the momentum's share plus the base batch's
            group = next(g for g in self.muon.param_groups if any(q is params[0] for q in g["params"]))
            mu = group["momentum"]
            coef, carry = (1 - mu * mu, mu * mu) if group["nesterov"] else (1 - mu, mu)
            bufs = [self.muon.state.get(p, {}).get("momentum_buffer") for p in params]
            batch = torch.stack([self.g_base[self.names[id(p)]].float() for p in params])
            kept = torch.stack([torch.zeros_like(g) if b is None else carry * b.float() for g, b in zip(batch, bufs)])
            pre.point = batch.mul_(coef).add_(kept)
        return pre


class FrozenMaps(_AroundStepMaps):
    """The maps before the derivative: utilities ⟨P G_i, ḡ⟩ through the frozen, self-adjoint P
    (AdamW's own map, Muon's Newton–Schulz frozen at the momentum)."""

    def __init__(self, opt: torch.optim.Optimizer) -> None:
        self.inner = OptimizerStepMaps(opt)

    def __call__(self, params, gbar):
        pre = self.inner(params, gbar)
        pre.utility_vector = pre.apply
        return pre


@dataclass
class Probe:
    """One state's utilities per map variant ([N_CAND] each), the real step's effects [N_CAND], and
    the float64 Muon step's relative error against torch's (0 for AdamW)."""

    utilities: dict[str, np.ndarray]
    effect: np.ndarray
    bf16_error: float


def probe(model: torch.nn.Module, opt: torch.optim.Optimizer, name: str, resolvers: dict[str, StepMaps],
          gen: torch.Generator, beta2: float = BETA2) -> Probe:
    """Draws K base rows, N_CAND candidates and N_TARGET target rows from ``gen``; scores the candidates with
    the GhostEngine through every resolver (under Muon also :class:`AtBaseBatch`) and measures effect_i on a
    float64 copy of ``opt``."""
    base, cands, target = windows(POOL, K, gen), windows(POOL, N_CAND, gen), windows(TARGET, N_TARGET, gen)
    step = RealStep(model, opt, name, beta2)
    G = per_sample_grads(step.model, cat(base, cands, target))
    g_base = {k: v[:K].mean(0) * K / (K + 1) for k, v in G.items()}
    g_target = {k: v[K + N_CAND :].mean(0) for k, v in G.items()}
    bf16_error, muon = 0.0, name == "muon"
    if muon:
        resolvers = {**resolvers, "at_base_batch": AtBaseBatch(opt, model, g_base)}
    engine = GhostEngine(model, include_embedding=True, include_head=True)
    utilities = {k: engine.score(row_losses(model), cat(cands, target), N_CAND, r).utilities.numpy()
                 for k, r in resolvers.items()}
    scored = [f"{layer}.weight" for layer, _ in engine.layers if layer != "wpe"]  # the position table is shared by all rows

    if muon:
        matrices = [k for k, p in step.params.items() if any(p is q for g in step.opt.muon.param_groups for q in g["params"])]
        torch_delta = step(g_base)
    with mock.patch.object(torch_muon, "_zeropower_via_newtonschulz", ns64) if muon else nullcontext():
        ref = step(g_base)
        if muon:
            bf16_error = max(relative(ref[k], torch_delta[k]) for k in matrices)
        effect = []
        for i in range(N_CAND):
            delta = step({k: g_base[k] + G[k][K + i] / (K + 1) for k in G})
            effect.append(-sum(float(((delta[k] - ref[k]) * g_target[k]).sum()) for k in scored))
    return Probe(utilities, np.array(effect), bf16_error)


def resolvers(opt: torch.optim.Optimizer, name: str) -> dict[str, StepMaps]:
    """The map variants of ``name``'s configuration (see the module docstring), as OPUS resolves them at K rows."""
    trainer = SimpleNamespace(optimizers=[opt], accumulate_grad_batches=1, world_size=1)
    if name == "adamw":
        return {"frozen": OPUSSelection().step_maps(trainer, K)}
    return {"momentum": OPUSSelection().step_maps(trainer, K), "frozen_ns": FrozenMaps(opt)}


def top_overlap(utility: np.ndarray, effect: np.ndarray, k: int = K) -> int:
    """|top-k candidates by utility ∩ top-k by effect|."""
    return len(set(np.argsort(-utility)[:k].tolist()) & set(np.argsort(-effect)[:k].tolist()))


def stages(name: str, beta2: float, seed: int, steps: list[int]) -> Iterator[tuple[int, Probe]]:
    """(step, probe) at each of ``steps`` of one training run (model seed ``seed``, data seed 100 + seed,
    probe rows from seed 7·seed + step)."""
    torch.manual_seed(seed)
    model = GPT(CFG)
    opt = make_optimizer(model, name, beta2)
    gen = torch.Generator().manual_seed(100 + seed)
    for step in range(1, max(steps) + 1):
        train_step(model, opt, gen)
        if step in steps:
            yield step, probe(model, opt, name, resolvers(opt, name), torch.Generator().manual_seed(7 * seed + step), beta2)


def summarise(states: list[dict]) -> list[dict]:
    """Per (configuration, step, variant): the per-seed Spearman ρ and top-K overlaps and their medians."""
    rows = []
    for (config, step) in dict.fromkeys((s["config"], s["step"]) for s in states):
        group = [s for s in states if s["config"] == config and s["step"] == step]
        for variant in group[0]["variants"]:
            rho = [s["variants"][variant]["spearman"] for s in group]
            top = [s["variants"][variant]["top_k"] for s in group]
            rows.append({"config": config, "step": step, "variant": variant, "seeds": [s["seed"] for s in group],
                         "spearman": rho, "median_spearman": statistics.median(rho), "top_k": top, "median_top_k": statistics.median(top)})
    return rows


def markdown(result: dict) -> str:
    """The summary table (median and per-seed values) and the machine line."""
    config = result["config"]
    lines = [f"Spearman ρ of OPUS utilities against the real step's marginal effects (N = {N_CAND} candidates, K = {K} base rows) "
             f"and top-{K} overlap |top-{K} by utility ∩ top-{K} by effect| ({K * K / N_CAND:.0f} expected at random); "
             f"seeds {', '.join(map(str, config['seeds']))}.", "",
             f"| configuration | step | variant | median ρ | ρ per seed | median top-{K} | top-{K} per seed |", "|" + "---|" * 7]
    for row in result["summary"]:
        lines.append(f"| {row['config']} | {row['step']} | {row['variant']} | {row['median_spearman']:.3f} | "
                     f"{' / '.join(f'{v:.3f}' for v in row['spearman'])} | {row['median_top_k']:g} | "
                     f"{' / '.join(map(str, row['top_k']))} |")
    machine = result["machine"]
    note = f", {machine['note']}" if machine["note"] else ""
    lines += ["", f"Machine: {machine['cpus']}-core CPU ({machine['platform']}), {machine['torch_threads']} torch thread(s){note}; "
              f"the run took {result['seconds']:.1f} s."]
    return "\n".join(lines) + "\n"


def build_parser() -> ArgumentParser:
    """The ``bench.studies.utility_ranking`` flags."""
    p = ArgumentParser(prog="python -m bench.studies.utility_ranking", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, help="output prefix: writes <out>.json and <out>.md (default: only print the table)")
    p.add_argument("--steps", default="5,50,300", help="comma-separated training steps to probe")
    p.add_argument("--seeds", default="0,1,2", help="comma-separated seeds (model, data and probe rows)")
    p.add_argument("--beta2s", default="0.95,0.999", help="AdamW β₂ values (empty for none)")
    p.add_argument("--muon", type=bool, default=True, help="also Muon (+ AdamW with β₂ = 0.95 on the rest)")
    p.add_argument("--note", default="", help="a remark on the machine for the table (e.g. that it was shared)")
    return p


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    steps, seeds = sorted(int(x) for x in args.steps.split(",")), [int(x) for x in args.seeds.split(",")]
    configs = [(f"AdamW β₂ = {b}", "adamw", b) for b in (float(x) for x in args.beta2s.split(",") if x)]
    configs += [("Muon + AdamW", "muon", BETA2)] if args.muon else []
    start = time.perf_counter()
    states = []
    for label, name, beta2 in configs:
        for seed in seeds:
            for step, got in stages(name, beta2, seed, steps):
                variants = {k: {"spearman": float(spearmanr(u, got.effect).statistic), "top_k": top_overlap(u, got.effect)}
                            for k, u in got.utilities.items()}
                states.append({"config": label, "optimizer": name, "beta2": beta2, "step": step, "seed": seed,
                               "bf16_error": got.bf16_error, "variants": variants})
                print(json.dumps(states[-1], ensure_ascii=False), flush=True)
    result = {"config": {"steps": steps, "seeds": seeds, "configs": [c[0] for c in configs], "K": K, "N": N_CAND,
                         "target": N_TARGET},
              "machine": {"cpus": os.cpu_count(), "platform": platform.machine(), "torch_threads": torch.get_num_threads(),
                          "note": args.note},
              "seconds": time.perf_counter() - start, "states": states, "summary": summarise(states)}
    table = markdown(result)
    print(table)
    if args.out is not None:
        write_json(args.out.with_suffix(".json"), result)
        args.out.with_suffix(".md").write_text(table)
    return result


if __name__ == "__main__":
    main()
