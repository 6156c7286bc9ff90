"""OPUS utilities against the step torch really takes, on a tiny GPT trained on text rows.

The reference is the real marginal effect of a candidate on one torch.optim step: with ḡ_B the mean
gradient of a base batch of K rows and g_i a candidate's,
effect_i = −⟨Δθ(K/(K+1)·ḡ_B + g_i/(K+1)) − Δθ(K/(K+1)·ḡ_B), ḡ_proxy⟩, Δθ(g) the parameter
change of one step of a float64 copy of the optimizer fed gradient g, summed over the parameters
the engine scores. Torch's Muon iterates Newton–Schulz in bfloat16, whose rounding swamps one
candidate's share; the reference runs the same coefficients and steps in float64 (checked against
torch's own step to bfloat16 tolerance).
"""

from __future__ import annotations

import copy
import statistics
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from scipy.stats import spearmanr
from torch.func import functional_call, grad, vmap
from torch.optim._muon import _adjust_lr

import torch.optim._muon as torch_muon
from selection_callbacks.data.tokenizer import ByteTokenizer
from selection_callbacks.methods import OPUSSelection
from selection_callbacks.nn.gpt import GPT, GPTConfig
from selection_callbacks.nn.optim import build_optimizer
from selection_callbacks.scoring.ghost import GhostEngine
from selection_callbacks.scoring.losses import mean_token_losses as row_losses
from selection_callbacks.scoring.preconditioners import TENSOR_FLOOR, NewtonSchulz, OptimizerPreconditioner
from tests.conftest import make_docs

T = 16
CFG = GPTConfig(vocab_size=320, block_size=T, n_layer=1, n_head=2, n_embd=32)
K, N_CAND, N_PROXY, TRAIN_BATCH = 16, 32, 8, 8
LR, WD, BETAS, MUON_LR, MUON_MU = 3e-3, 0.1, (0.9, 0.95), 0.02, 0.95
STEPS, SEEDS = (5, 300), (0, 1, 2)
# torch's bfloat16 Newton–Schulz is 4–7% (relative Frobenius) from exact arithmetic on these momenta,
# float32 2e-6: five steps of a polynomial with slope 3.4 at 0 amplify bfloat16's 2⁻⁸ rounding
BF16_STEP = 0.1
NS = NewtonSchulz((torch_muon.DEFAULT_A, torch_muon.DEFAULT_B, torch_muon.DEFAULT_C), torch_muon.DEFAULT_NS_STEPS, torch_muon.EPS)


def stream(docs: list[dict]) -> torch.Tensor:
    tok = ByteTokenizer()
    return torch.from_numpy(np.concatenate([tok.encode_document(d["text"]) for d in docs]).astype(np.int64))


POOL = stream(make_docs("p", 240, 0))  # prose and printable noise
TARGET = stream(make_docs("t", 40, 1, ("prose",)))


def windows(ids: torch.Tensor, n: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    starts = torch.randint(0, ids.numel() - T - 1, (n,), generator=gen)
    rows = torch.stack([ids[s : s + T + 1] for s in starts.tolist()])
    return {"input_ids": rows[:, :-1], "labels": rows[:, 1:]}


def cat(*batches: dict) -> dict:
    return {k: torch.cat([b[k] for b in batches]) for k in batches[0]}


def make_optimizer(model: torch.nn.Module, name: str) -> torch.optim.Optimizer:
    return build_optimizer(model, name, LR, WD, BETAS, MUON_LR, MUON_MU, 0.0)


def per_sample_grads(model: torch.nn.Module, batch: dict) -> dict[str, torch.Tensor]:
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

    def __init__(self, model: torch.nn.Module, opt: torch.optim.Optimizer, name: str) -> None:
        self.model = copy.deepcopy(model).double()
        self.opt = make_optimizer(self.model, name)
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
    return float((a - b).norm() / b.norm())


class FrozenMaps:
    """The maps before the derivative: utilities ⟨P G_i, ḡ⟩ through the frozen, self-adjoint P
    (AdamW with ḡ² in v, Muon's Newton–Schulz frozen at the momentum)."""

    def __init__(self, opt: torch.optim.Optimizer) -> None:
        self.inner = OptimizerPreconditioner(opt, "proxy_in_v")

    def group_key(self, param):
        return self.inner.group_key(param)

    def __call__(self, params, gbar, step=None):
        pre = self.inner(params, gbar)
        pre.utility_vector = pre.apply
        return pre


def spearman_against_real_step(model, opt, name: str, gen: torch.Generator, monkeypatch) -> tuple[dict[str, float], float]:
    """(Spearman against the real step's effects of OPUS's utilities with Muon's derivative at the batch point, at
    the momentum alone (the default), and of the frozen maps; relative error of the float64 Muon step against
    torch's own)."""
    base, cands, proxy = windows(POOL, K, gen), windows(POOL, N_CAND, gen), windows(TARGET, N_PROXY, gen)
    engine = GhostEngine(model, include_embedding=True, include_head=True)
    trainer = SimpleNamespace(optimizers=[opt], accumulate_grad_batches=1)
    resolvers = {"batch": OPUSSelection(muon_point="batch").preconditioner(trainer, K),
                 "momentum": OPUSSelection().preconditioner(trainer, K), "frozen": FrozenMaps(opt)}
    utilities = {k: engine.score(row_losses(model), cat(cands, proxy), N_CAND, r).utilities for k, r in resolvers.items()}
    scored = [f"{name}.weight" for name, _ in engine.layers if name != "wpe"]  # the position table is shared by all rows

    step = RealStep(model, opt, name)
    G = per_sample_grads(step.model, cat(base, cands, proxy))
    g_base = {k: v[:K].mean(0) * K / (K + 1) for k, v in G.items()}
    g_proxy = {k: v[K + N_CAND :].mean(0) for k, v in G.items()}
    bf16_error = 0.0
    with monkeypatch.context() as patch:
        if name == "muon":
            muon = [k for k, p in step.params.items() if any(p is q for g in step.opt.muon.param_groups for q in g["params"])]
            torch_delta = step(g_base)
            patch.setattr(torch_muon, "_zeropower_via_newtonschulz", ns64)
            f64_delta = step(g_base)
            bf16_error = max(relative(f64_delta[k], torch_delta[k]) for k in muon)
        ref = step(g_base)
        effect = []
        for i in range(N_CAND):
            delta = step({k: g_base[k] + G[k][K + i] / (K + 1) for k in G})
            effect.append(-sum(float(((delta[k] - ref[k]) * g_proxy[k]).sum()) for k in scored))
    return {k: float(spearmanr(u.numpy(), effect).statistic) for k, u in utilities.items()}, bf16_error


@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_utilities_rank_like_the_real_step(name: str, monkeypatch) -> None:
    rho: dict[int, list[dict[str, float]]] = {s: [] for s in STEPS}
    for seed in SEEDS:
        torch.manual_seed(seed)
        model = GPT(CFG)
        opt = make_optimizer(model, name)
        gen = torch.Generator().manual_seed(100 + seed)
        for step in range(1, max(STEPS) + 1):
            opt.zero_grad()
            row_losses(model)(windows(POOL, TRAIN_BATCH, gen)).mean().backward()
            opt.step()
            if step in STEPS:
                got, bf16_error = spearman_against_real_step(model, opt, name, torch.Generator().manual_seed(7 * seed + step), monkeypatch)
                assert bf16_error < BF16_STEP  # the float64 Newton–Schulz is torch's step up to its bfloat16 rounding
                rho[step].append(got)
                print(f"{name} seed {seed} step {step}: Spearman", {k: round(v, 3) for k, v in got.items()}, f"(bf16 step error {bf16_error:.3f})")
    for step in STEPS:
        medians = {k: statistics.median(r[k] for r in rho[step]) for k in rho[step][0]}
        print(f"{name} step {step}: median Spearman", {k: round(v, 3) for k, v in medians.items()})
        assert medians["batch"] >= 0.9, (step, rho[step])  # AdamW's map is the same at both points


def test_newton_schulz_copy_reproduces_torch_muon_step() -> None:
    torch.manual_seed(0)
    model = GPT(CFG)
    opt = make_optimizer(model, "muon")
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        opt.zero_grad()
        row_losses(model)(windows(POOL, TRAIN_BATCH, gen)).mean().backward()
        opt.step()
    opt.zero_grad()
    row_losses(model)(windows(POOL, TRAIN_BATCH, gen)).mean().backward()
    muon = opt.muon.param_groups[0]["params"]
    before = [p.detach().clone() for p in muon]
    U = [MUON_MU**2 * opt.state[p]["momentum_buffer"] + (1 - MUON_MU**2) * p.grad for p in muon]
    opt.step()
    for p, theta, u in zip(muon, before, U):
        want = -_adjust_lr(MUON_LR, None, p.shape) * NS(u[None])[0]
        assert relative(p.detach() - theta, want) < BF16_STEP  # torch rounds every Newton–Schulz product to bfloat16
        assert relative(NS(u[None])[0].double(), ns64(u, NS.coefficients, NS.steps, NS.eps)) < 1e-5


@pytest.mark.parametrize("shape", [(2, 16, 48), (2, 48, 16), (1, 24, 24)])
def test_newton_schulz_vjp_matches_float64_autograd_and_finite_differences(shape) -> None:
    gen = torch.Generator().manual_seed(0)
    x, v, h = (torch.randn(*shape, generator=gen, dtype=torch.float64) for _ in range(3))
    got = NS.vjp(x, v)
    assert got.dtype == torch.float32
    x64 = x.clone().requires_grad_(True)
    want = torch.autograd.grad(ns64(x64, NS.coefficients, NS.steps, NS.eps), x64, v)[0]
    assert relative(got.double(), want) < 1e-4
    eps = 1e-6
    fd = ((ns64(x + eps * h, NS.coefficients, NS.steps, NS.eps) - ns64(x - eps * h, NS.coefficients, NS.steps, NS.eps)) * v).sum() / (2 * eps)
    assert float((got.double() * h).sum()) == pytest.approx(float(fd), rel=1e-4)


def test_adamw_map_is_the_derivative_of_torch_step_at_frozen_moments() -> None:
    torch.manual_seed(0)
    model = GPT(CFG)
    opt = make_optimizer(model, "adamw")
    gen = torch.Generator().manual_seed(0)
    for _ in range(5):
        opt.zero_grad()
        row_losses(model)(windows(POOL, TRAIN_BATCH, gen)).mean().backward()
        opt.step()
    step = RealStep(model, opt, "adamw")
    zero = {k: torch.zeros_like(p) for k, p in step.params.items()}
    h = {k: torch.randn(p.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1)) for k, p in step.params.items()}
    eps = 1e-7  # v' = β2 v + (1 − β2)(εh)²: the fresh gradient's share of v is ~1e-14 of it
    moved, rest = step({k: eps * h[k] for k in h}), step(zero)
    resolve = OptimizerPreconditioner(opt)
    for k in ("blocks.0.attn.qkv.weight", "wte.weight", "lm_head.weight"):
        p = dict(model.named_parameters())[k]
        pre = resolve([p], torch.zeros_like(p)[None])
        want = -(moved[k] - rest[k]) / eps
        v = opt.state[p]["exp_avg_sq"]
        formed = v >= TENSOR_FLOOR * v.mean()  # elsewhere (unseen bytes, early q/k rows) the floor caps lr/ε
        assert float(formed.float().mean()) > 0.2
        assert relative(pre.apply(h[k].float()[None])[0].double()[formed], want[formed]) < 1e-4


def test_first_step_maps_fall_back_to_the_proxy_gradient() -> None:
    model = GPT(CFG)
    gbar = 1e-3 * torch.randn_like(model.blocks[0].mlp.fc.weight)[None]
    adamw = make_optimizer(model, "adamw")
    frozen = OptimizerPreconditioner(adamw)([model.blocks[0].mlp.fc.weight], gbar)
    proxy_in_v = OptimizerPreconditioner(adamw, "proxy_in_v")([model.blocks[0].mlp.fc.weight], gbar)
    torch.testing.assert_close(frozen.utility_vector(gbar), proxy_in_v.utility_vector(gbar))
    muon = make_optimizer(model, "muon")
    pre = OptimizerPreconditioner(muon)([model.blocks[0].mlp.fc.weight], gbar)
    torch.testing.assert_close(pre.points[0], (1 - MUON_MU**2) * gbar)  # no momentum, no draws: the proxy's own update
    assert bool(pre.utility_vector(gbar).isfinite().all())


def test_unknown_adamw_map_is_refused() -> None:
    with pytest.raises(ValueError, match="adamw_map"):
        OptimizerPreconditioner(make_optimizer(GPT(CFG), "adamw"), "exact")


@pytest.mark.parametrize("stack", [False, True])
def test_muon_batch_point_utilities_match_brute_force(stack: bool) -> None:
    """The engine's Muon utilities at the batch point: the VJPs at μ²·buf + (1 − μ²)·ḡ_S for the same drawn
    candidate rows S in every layer, from explicit per-sample gradients."""
    torch.manual_seed(0)
    model = GPT(CFG)
    opt = make_optimizer(model, "muon")
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        opt.zero_grad()
        row_losses(model)(windows(POOL, TRAIN_BATCH, gen)).mean().backward()
        opt.step()
    n, rows, draws, seed = 6, 4, 3, 5
    batch = cat(windows(POOL, n, gen), windows(TARGET, N_PROXY, gen))
    engine = GhostEngine(model, stack_layers=stack)
    got = engine.score(row_losses(model), batch, n, OptimizerPreconditioner(opt, muon_batch=rows, muon_draws=draws), seed)
    G = per_sample_grads(model, batch)
    draw = torch.Generator().manual_seed(seed)
    subsets = [torch.randperm(n, generator=draw)[:rows] for _ in range(draws)]
    coef = 1 - MUON_MU**2
    for name, p in model.named_parameters():
        layer = name.removesuffix(".weight")
        if layer not in got.layer_utilities:
            continue
        points = torch.stack([MUON_MU**2 * opt.state[p]["momentum_buffer"] + coef * G[name][S].mean(0) for S in subsets])
        gbar = G[name][n:].mean(0)
        q = _adjust_lr(MUON_LR, None, p.shape) * coef * NS.vjp(points, gbar.expand_as(points)).mean(0)
        want = (G[name][:n] * q).flatten(1).sum(1)
        torch.testing.assert_close(got.layer_utilities[layer], want, rtol=1e-3, atol=1e-4 * float(want.abs().max()))
