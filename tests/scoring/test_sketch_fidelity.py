"""Sketches late in training: the engine's sketch of P G_i against the exact preconditioned Gram.

The state: the tiny GPT of ``test_opus_maps`` (output head scored) trained 300 steps under torch's
AdamW (β₂ = 0.95). The reference is the exact-chunked CountSketch of the formed P G_i; the
error of a sketch on candidates i < j is e_ij = (⟨S_i, S_j⟩ − ⟨P G_i, P G_j⟩) / (‖P G_i‖‖P G_j‖).
"""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from selection_callbacks.nn.gpt import GPT
from selection_callbacks.scoring.ghost.engine import FACTOR_TOLERANCE, GhostEngine
from selection_callbacks.scoring.losses import mean_token_losses as row_losses
from selection_callbacks.scoring.maps.step_maps import OptimizerStepMaps
from selection_callbacks.scoring.sketch import TensorSketch
from tests.scoring.test_maps import CFG, POOL, TARGET, TRAIN_BATCH, cat, make_optimizer, per_sample_grads, windows

STEP, M, N, PROXY, SEEDS = 300, 1024, 16, 8, 8


@pytest.fixture(scope="module")
def late_adamw():
    """(model, optimizer, rows, exact Gram [N, N] of Σ_layers ⟨P G_i, P G_j⟩) after 300 AdamW steps."""
    torch.manual_seed(0)
    model = GPT(CFG)
    opt = make_optimizer(model, "adamw")
    gen = torch.Generator().manual_seed(100)
    for _ in range(STEP):
        opt.zero_grad()
        row_losses(model)(windows(POOL, TRAIN_BATCH, gen)).mean().backward()
        opt.step()
    batch = cat(windows(POOL, N, gen), windows(TARGET, PROXY, gen))
    resolve, params = OptimizerStepMaps(opt), dict(model.named_parameters())
    G = per_sample_grads(model, batch)
    gram = torch.zeros(N, N)
    for name, _ in GhostEngine(model, include_head=True).layers:
        g = G[f"{name}.weight"]
        PG = resolve([params[f"{name}.weight"]], g[N:].mean(0)[None]).apply(g[None, :N])[0].flatten(1)
        gram += PG @ PG.T
    return model, opt, batch, gram


def pair_errors(engine: GhostEngine, model, opt, batch, gram) -> tuple[list[float], list[float]]:
    """Per hash seed: the mean over pairs of |e_ij| and of e_ij."""
    norms = gram.diagonal().sqrt()
    iu = torch.triu_indices(N, N, 1)
    absolute, signed = [], []
    for seed in range(SEEDS):
        S = engine.score(row_losses(model), batch, N, OptimizerStepMaps(opt), seed=seed).sketches
        e = ((S @ S.T - gram) / torch.outer(norms, norms))[iu[0], iu[1]]
        absolute.append(float(e.abs().mean()))
        signed.append(float(e.mean()))
    return absolute, signed


def test_adamw_sketch_is_faithful_at_step_300(late_adamw) -> None:
    model, opt, batch, gram = late_adamw
    engines = {"count": GhostEngine(model, include_head=True, sketch_dim=M, sketch="count"),
               "tensor": GhostEngine(model, include_head=True, sketch_dim=M),
               "formed": GhostEngine(model, include_head=True, sketch_dim=M, factor_tolerance=0.0),
               "factored": GhostEngine(model, include_head=True, sketch_dim=M, factor_tolerance=math.inf)}
    errors = {k: pair_errors(e, model, opt, batch, gram) for k, e in engines.items()}
    for k, (absolute, signed) in errors.items():
        print(f"{k}: mean |e| {statistics.mean(absolute):.4f}, mean e {statistics.mean(signed):+.4f} "
              f"± {statistics.stdev(signed) / math.sqrt(SEEDS):.4f}")
    factored = engines["tensor"].score(row_losses(model), batch, N, OptimizerStepMaps(opt), seed=0).factored
    assert factored and "lm_head" not in factored  # the default factors the hidden layers, forms the head (ρ 0.73)
    for kind in ("tensor", "formed"):
        absolute, signed = errors[kind]
        assert statistics.mean(absolute) <= 1.5 * statistics.mean(errors["count"][0])
        assert abs(statistics.mean(signed)) <= 2 * statistics.stdev(signed) / math.sqrt(SEEDS)
    # factors for the head too (its rows never seen keep v far from rank 1): beyond both bounds
    absolute, signed = errors["factored"]
    assert statistics.mean(absolute) > 1.5 * statistics.mean(errors["count"][0])
    assert abs(statistics.mean(signed)) > 2 * statistics.stdev(signed) / math.sqrt(SEEDS)


def test_sketch_error_probe_is_the_real_error(late_adamw) -> None:
    """``sketch_error`` on the first k candidates equals the error against the brute-force Gram; the factored path
    reports which layers it factored and their ρ."""
    model, opt, batch, gram = late_adamw
    k = 4
    for tolerance in (0.0, math.inf):
        engine = GhostEngine(model, include_head=True, sketch_dim=M, factor_tolerance=tolerance)
        got = engine.score(row_losses(model), batch, N, OptimizerStepMaps(opt), seed=3, probe=k)
        S, exact = got.sketches[:k], gram[:k, :k]
        est, norms = S @ S.T, exact.diagonal().sqrt()
        iu = torch.triu_indices(k, k, 1)
        want = ((est - exact).abs() / torch.outer(norms, norms))[iu[0], iu[1]].mean()
        torch.testing.assert_close(got.sketch_error["gram"], want, rtol=1e-3, atol=1e-5)
        torch.testing.assert_close(got.sketch_error["sq_norm"], (est.diagonal() / exact.diagonal() - 1).mean(), rtol=1e-3, atol=1e-5)
        assert got.factored == ([] if tolerance == 0 else [name for name, _ in engine.layers])
    print("ρ per layer:", {name: round(float(v), 3) for name, v in got.relative_factor_error.items()})
    pre = OptimizerStepMaps(opt)([model.lm_head.weight], torch.zeros(1, *model.lm_head.weight.shape))
    r, c = pre.rank1()
    q = torch.outer(r[0], c[0]) / pre.D[0]
    explicit = ((q * q.square().mean().rsqrt() - 1) ** 2).mean().sqrt()
    torch.testing.assert_close(pre.relative_factor_error[0], explicit, rtol=1e-4, atol=1e-6)
    assert float(pre.relative_factor_error[0]) > FACTOR_TOLERANCE  # the head: the default forms its P G_i


@pytest.mark.parametrize("block, m, layers, offsets", [(None, 64, [0, 1], None), (16, 64, [0, 2], [0, 32]), (7, 40, [2, 4], [30, 9])])
def test_tensor_sketch_of_matrices_is_its_count_sketch(block, m, layers, offsets) -> None:
    """``TensorSketch.matrices`` hashes explicit matrices exactly as the factor path hashes Σ_t b aᵀ (same bins, signs)."""
    g = torch.Generator().manual_seed(0)
    ts = TensorSketch(m, 12, 9, 3, layers, torch.device("cpu"), block=block, offsets=offsets)
    b, a = torch.randn(2, 5, 4, 12, generator=g), torch.randn(2, 5, 4, 9, generator=g)
    mats = torch.einsum("lnto,lnti->lnoi", b, a)
    bins, signs = ts.explicit()
    want = torch.zeros(5, m)
    for layer in range(2):
        want.index_add_(1, bins[layer], mats[layer].flatten(1) * signs[layer])
    torch.testing.assert_close(ts.matrices(mats), want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(ts(b, a), want, rtol=1e-4, atol=1e-4)


def test_opus_logs_the_real_sketch_error(tiny_corpus) -> None:
    """Under AdamW the callback logs ρ and the factored layer count every step, and the probed
    sketch error on the diagnostic selections (the first and the sixth of six)."""
    from selection_callbacks.methods import OPUSSelection
    from tests.methods.opus.test_opus import _fit

    selector = OPUSSelection(ratio=0.5, score_len=16, sketch_dim=256, sketch_check=4, diagnostics_every=5)
    seen = _fit(tiny_corpus, selector, steps=6)
    assert [c["step"] for c in selector.diagnostics] == [0, 5]
    assert all(0 < c["sketch_error"] < 1 and abs(c["sketch_norm_bias"]) < 1 for c in selector.diagnostics)
    assert all(r["select/factor_rho"] > 0 and (r["select/factored_layers"] > 0) == ("select/factor_error" in r) for r in seen.rows)
