"""Ghost-gradient engine against brute force (torch.func per-sample gradients) on a tiny GPT."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call, grad, vmap

import selection_callbacks.scoring.ghost.engine as ghost
from selection_callbacks.nn.gpt import GPT, GPTConfig
from selection_callbacks.nn.optim import build_optimizer
from selection_callbacks.scoring.ghost.engine import GhostEngine, check_precision
from selection_callbacks.scoring.ghost.layers import scored_layers
from selection_callbacks.scoring.losses import mean_token_losses as row_losses
from selection_callbacks.scoring.maps.muon import NewtonSchulz, newton_schulz_left_factor
from selection_callbacks.scoring.maps.step_maps import IdentityStepMaps, OptimizerStepMaps
from selection_callbacks.scoring.sketch import TensorSketch, sketch_blocks

N_CAND, N_TARGET, T = 5, 3, 8
GROUP_BY_DEFAULT = ghost.group_by_default  # the engine's own rule (the fixture below replaces it)


@pytest.fixture(autouse=True, params=["grouped", "per_layer"])
def grouping(request, monkeypatch) -> str:
    """Every engine test runs with same-shaped layers grouped (the accelerator default) and one by one (CPU's)."""
    monkeypatch.setattr(ghost, "group_by_default", lambda device, resolve, param: request.param == "grouped")
    return request.param


def make_optimizer(model, name: str):
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return build_optimizer(model, name, 3e-3, 0.1, (0.9, 0.95), 0.02, 0.95, 0.0)


def trained(name: str, steps: int = 3, bias: bool = False, seed: int = 0):
    torch.manual_seed(seed)
    model = GPT(GPTConfig(vocab_size=64, block_size=T, n_layer=2, n_head=2, n_embd=16, bias=bias))
    opt = make_optimizer(model, name)
    for _ in range(steps):
        ids = torch.randint(0, 64, (8, T + 1))
        opt.zero_grad()
        row_losses(model)({"input_ids": ids[:, :-1], "labels": ids[:, 1:]}).mean().backward()
        opt.step()
    return model, opt


def rows(seed: int = 1, n: int = N_CAND + N_TARGET):
    ids = torch.randint(0, 64, (n, T + 1), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}


def per_sample_grads(model, batch) -> dict[str, torch.Tensor]:
    params = {k: v.detach() for k, v in model.named_parameters()}

    def single(p, x, y):
        logits = functional_call(model, p, (x[None],))
        return F.cross_entropy(logits[0], y)

    return vmap(grad(single), in_dims=(None, 0, 0))(params, batch["input_ids"], batch["labels"])


def brute_force(model, batch, resolver, layers, n=N_CAND):
    """u_i = Σ ⟨G_i, −Jᵀḡ⟩ (the maps' utility vectors), K_ij = Σ ⟨P G_i, P G_j⟩ from explicit per-sample gradients."""
    G = per_sample_grads(model, batch)
    params = dict(model.named_parameters())
    u, gram = torch.zeros(n), torch.zeros(n, n)
    for name, module in layers:
        for pname in ("weight", "bias"):
            full = f"{name}.{pname}"
            if getattr(module, pname, None) is None:
                continue
            gbar = G[full][n:].mean(0)
            P = resolver([params[full]], gbar[None])
            PG = P.apply(G[full][None, :n])[0]
            u += (G[full][:n] * P.utility_vector(gbar[None])[0]).flatten(1).sum(1)
            gram += PG.flatten(1) @ PG.flatten(1).T
    return u, gram


@pytest.mark.parametrize("opt_name", ["sgd", "adamw", "muon"])
@pytest.mark.parametrize("steps", [0, 3])
def test_utilities_match_brute_force(opt_name: str, steps: int) -> None:
    model, opt = trained(opt_name, steps)
    batch = rows()
    resolver = OptimizerStepMaps(opt)
    engine = GhostEngine(model, include_embedding=True, include_head=True)
    got = engine.score(row_losses(model), batch, N_CAND, resolver)
    layers = [(n, m) for n, m in scored_layers(model, True, True) if n not in got.shared]
    assert got.shared == ["wpe"]  # the position table is shared by all rows
    want, _ = brute_force(model, batch, resolver, layers)
    torch.testing.assert_close(got.utilities, want, rtol=1e-4, atol=1e-6 * float(want.abs().max()))
    assert float(want.abs().min()) > 0


@pytest.mark.parametrize("opt_name", ["sgd", "adamw"])
def test_linear_biases_are_scored(opt_name: str) -> None:
    model, opt = trained(opt_name, 2, bias=True)
    batch, resolver = rows(), OptimizerStepMaps(opt)
    got = GhostEngine(model).score(row_losses(model), batch, N_CAND, resolver)
    want, _ = brute_force(model, batch, resolver, scored_layers(model))
    torch.testing.assert_close(got.utilities, want, rtol=1e-4, atol=1e-7)


def test_no_parameter_grad_is_touched() -> None:
    model, opt = trained("adamw", 2)
    sentinel = {n: torch.full_like(p, 7.0) for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        p.grad = sentinel[n].clone() if n.startswith("blocks.0") else None
    GhostEngine(model, sketch_dim=64).score(row_losses(model), rows(), N_CAND, OptimizerStepMaps(opt))
    for n, p in model.named_parameters():
        if n.startswith("blocks.0"):
            assert torch.equal(p.grad, sentinel[n])
        else:
            assert p.grad is None


@pytest.mark.parametrize("opt_name, sketch", [("sgd", "tensor"), ("muon", "tensor"), ("adamw", "count"), ("muon", "two_sided")])
def test_engine_sketches_are_unbiased(opt_name: str, sketch: str) -> None:
    model, opt = trained(opt_name, 3)
    batch, resolver = rows(), OptimizerStepMaps(opt)
    engine = GhostEngine(model, sketch_dim=256, sketch=sketch)
    _, gram = brute_force(model, batch, resolver, scored_layers(model))
    est = torch.stack([
        (lambda s: s @ s.T)(engine.score(row_losses(model), batch, N_CAND, resolver, seed=seed).sketches)
        for seed in range(60)
    ])
    iu = torch.triu_indices(N_CAND, N_CAND, 1)
    z = (est.mean(0) - gram) / (est.std(0) / math.sqrt(est.shape[0]))
    assert float(z[iu[0], iu[1]].abs().max()) < 4.0
    scale = torch.outer(gram.diagonal(), gram.diagonal()).sqrt()
    assert float(((est.mean(0) - gram).abs() / scale).max()) < 0.25


@pytest.mark.parametrize("tolerance", [0.0, math.inf])
def test_adamw_utilities_are_exact_beside_either_sketch_path(tolerance: float) -> None:
    """AdamW with a tensor sketch, formed (factor_tolerance 0: the utilities read the formed G_i the sketch hashes)
    or through the factors (∞: the utilities' own product): the utilities match per-sample gradients, and the formed
    sketch is each layer's CountSketch of P G_i in its block."""
    model, opt = trained("adamw", 3)
    batch, resolver = rows(), OptimizerStepMaps(opt)
    engine = GhostEngine(model, include_head=True, sketch_dim=256, factor_tolerance=tolerance)
    got = engine.score(row_losses(model), batch, N_CAND, resolver, seed=2)
    want, _ = brute_force(model, batch, resolver, scored_layers(model, include_head=True))
    torch.testing.assert_close(got.utilities, want, rtol=1e-4, atol=1e-6 * float(want.abs().max()))
    if tolerance == 0.0:
        G, params = per_sample_grads(model, batch), dict(model.named_parameters())
        blocks, sketch = sketch_blocks([m.weight.numel() for _, m in engine.layers], 256), torch.zeros(N_CAND, 256)
        for index, (name, _) in enumerate(engine.layers):
            grads = G[f"{name}.weight"]
            PG = resolver([params[f"{name}.weight"]], grads[N_CAND:].mean(0)[None]).apply(grads[None, :N_CAND])[0]
            offset, n = blocks[index]
            bins, signs = TensorSketch(256, *PG.shape[1:], 2, [index], torch.device("cpu"), n, [offset]).explicit()
            sketch.index_add_(1, bins[0], PG.flatten(1) * signs[0])
        torch.testing.assert_close(got.sketches, sketch, rtol=1e-4, atol=1e-4 * float(sketch.abs().max()))


@pytest.mark.parametrize("opt_name", ["sgd", "muon"])
def test_engine_tensor_sketch_is_each_layers_count_sketch_in_its_block(opt_name: str) -> None:
    """Exact maps (SGD, Muon; the embedding's AdamW diagonal is gathered exactly, only a linear layer's AdamW map is
    factorised, so Muon's AdamW head stays out): the sketch is Σ_layers the CountSketch of P G_i under the layer's
    own hash into its own block of bins (sized by the layer's weights), built here from explicit per-sample gradients."""
    model, opt = trained(opt_name, 3)
    batch, resolver = rows(), OptimizerStepMaps(opt)
    engine = GhostEngine(model, include_embedding=True, include_head=opt_name == "sgd", sketch_dim=100)
    got = engine.score(row_losses(model), batch, N_CAND, resolver, seed=5)
    G, params = per_sample_grads(model, batch), dict(model.named_parameters())
    blocks, want = sketch_blocks([m.weight.numel() for _, m in engine.layers], 100), torch.zeros(N_CAND, 100)
    for index, (name, _) in enumerate(engine.layers):
        if name in got.shared:
            continue
        grads = G[f"{name}.weight"]
        PG = resolver([params[f"{name}.weight"]], grads[N_CAND:].mean(0)[None]).apply(grads[None, :N_CAND])[0]
        offset, n = blocks[index]
        bins, signs = TensorSketch(100, *PG.shape[1:], 5, [index], torch.device("cpu"), n, [offset]).explicit()
        want.index_add_(1, bins[0], PG.flatten(1) * signs[0])
    tol = 1e-3 if opt_name == "muon" else 1e-4
    torch.testing.assert_close(got.sketches, want, rtol=tol, atol=tol * float(want.abs().max()))


def test_tensor_sketch_needs_a_bin_per_layer() -> None:
    model, _ = trained("sgd", 0)
    with pytest.raises(ValueError, match="no bin of its own"):
        GhostEngine(model, sketch_dim=7)


def test_adamw_rank1_factor_error_is_reported() -> None:
    model, opt = trained("adamw", 5)
    got = GhostEngine(model, sketch_dim=128).score(row_losses(model), rows(), N_CAND, OptimizerStepMaps(opt))
    assert set(got.factor_error) == {n for n, _ in scored_layers(model)}
    assert all(0.0 < e < 1.0 for e in got.factor_error.values())
    quiet = GhostEngine(model, sketch_dim=128).score(row_losses(model), rows(), N_CAND, OptimizerStepMaps(opt),
                                                     factor_errors=False)  # the diagnostic left out, nothing else
    assert quiet.factor_error == {} and quiet.factored == got.factored
    assert quiet.relative_factor_error.keys() == got.relative_factor_error.keys()
    assert torch.equal(quiet.utilities, got.utilities) and torch.equal(quiet.sketches, got.sketches)
    fc = [model.blocks[0].mlp.fc.weight, model.blocks[1].mlp.fc.weight]
    P = OptimizerStepMaps(opt)(fc, torch.randn(2, *fc[0].shape))
    r, c = P.rank1()
    for i in range(2):  # each grouped layer gets its own rescaled rank-1 factors and errors
        q = torch.outer(r[i], c[i]) / P.D[i]
        kappa = q.square().mean().rsqrt()
        torch.testing.assert_close(P.norm_scale[i], kappa, rtol=1e-4, atol=1e-6)
        explicit = torch.linalg.norm(P.D[i] - kappa * torch.outer(r[i], c[i])) / torch.linalg.norm(P.D[i])
        torch.testing.assert_close(P.factor_error[i], explicit, rtol=1e-3, atol=1e-5)
        torch.testing.assert_close(P.relative_factor_error[i], (kappa * q - 1).square().mean().sqrt(), rtol=1e-3, atol=1e-5)


def test_rescaled_factors_keep_squared_norms_under_adams_normalisation() -> None:
    """With every entry of P g of one scale (g_oi ~ N(0, 1/D_oi²)), E‖κ (r cᵀ) ⊙ g‖² = E‖D ⊙ g‖² (Monte Carlo over
    200,000 draws); the unscaled best rank-1 factors miss it."""
    from selection_callbacks.scoring.maps.adamw import DiagonalMap

    g = torch.Generator().manual_seed(0)
    D = torch.rand(1, 24, 16, generator=g).add_(0.05).pow_(2) * torch.rand(24, 1, generator=g).add_(0.5)  # far from rank 1
    P = DiagonalMap(1.0, D)
    r, c = P.rank1()
    factors = torch.outer(r[0], c[0])
    draws = torch.randn(200_000, 24, 16, generator=g, dtype=torch.float64) / D[0].double()
    exact = (D[0].double() * draws).square().sum((1, 2)).mean()
    scaled = (float(P.norm_scale[0]) * factors.double() * draws).square().sum((1, 2)).mean()
    unscaled = (factors.double() * draws).square().sum((1, 2)).mean()
    assert abs(float(scaled / exact) - 1) < 0.01
    assert abs(float(unscaled / exact) - 1) > 0.05
    assert float(P.relative_factor_error[0]) > 0.2  # the test's D is not near rank 1


@pytest.mark.parametrize("opt_name", ["sgd", "muon", "adamw"])
def test_squared_norms_match_brute_force(opt_name: str) -> None:
    model, opt = trained(opt_name, 3)
    batch, resolver = rows(), OptimizerStepMaps(opt)
    got = GhostEngine(model, norms=True).score(row_losses(model), batch, N_CAND, resolver)
    _, gram = brute_force(model, batch, resolver, scored_layers(model))
    torch.testing.assert_close(got.sq_norms, gram.diagonal(), rtol=1e-4, atol=0)


@pytest.mark.parametrize("shape", [(24, 40), (40, 24), (32, 32)])
def test_muon_factor_reproduces_torch_newton_schulz(shape) -> None:
    from torch.optim._muon import _zeropower_via_newtonschulz

    u = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    coeffs = (3.4445, -4.7750, 2.0315)
    L, norm, tall = newton_schulz_left_factor(u, coeffs, 5, 1e-7)
    ours = (u / norm) @ L if tall else L @ (u / norm)
    theirs = _zeropower_via_newtonschulz(u, coeffs, 5, 1e-7).float()
    assert float((ours - theirs).norm() / theirs.norm()) < 2e-2  # torch runs the iteration in bf16
    torch.testing.assert_close(L, L.T, rtol=1e-3, atol=1e-5)


def test_bf16_autocast_agrees_with_fp32() -> None:
    model, opt = trained("adamw", 3)
    batch, resolver = rows(), OptimizerStepMaps(opt)
    exact = GhostEngine(model).score(row_losses(model), batch, N_CAND, resolver).utilities
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = GhostEngine(model).score(row_losses(model), batch, N_CAND, resolver).utilities
    assert low.dtype == torch.float32
    assert float(torch.corrcoef(torch.stack([exact, low]))[0, 1]) > 0.98


def test_torch_compile_works_or_raises_never_zeros() -> None:
    model, opt = trained("sgd", 2)
    batch, resolver = rows(), OptimizerStepMaps(opt)
    eager = GhostEngine(model).score(row_losses(model), batch, N_CAND, resolver).utilities
    compiled = torch.compile(model, backend="eager")
    try:
        got = GhostEngine(model).score(row_losses(compiled), batch, N_CAND, resolver).utilities
    except RuntimeError as e:
        assert "hooks did not fire" in str(e)
    else:
        torch.testing.assert_close(got, eager, rtol=1e-4, atol=1e-8)


def test_fp16_grad_scaler_is_refused() -> None:
    from lightning.pytorch.plugins.precision import MixedPrecision

    class FakeTrainer:
        precision_plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))

    with pytest.raises(ValueError, match="fp16 GradScaler"):
        check_precision(FakeTrainer())

    class Bf16Trainer:
        precision_plugin = MixedPrecision("bf16-mixed", "cpu")

    check_precision(Bf16Trainer())


def test_unknown_optimizer_names_the_supported_ones() -> None:
    model = GPT(GPTConfig(vocab_size=64, block_size=T, n_layer=1, n_head=2, n_embd=16))
    with pytest.raises(TypeError, match="Adagrad.*supported: torch.optim.SGD, torch.optim.AdamW, torch.optim.Muon"):
        OptimizerStepMaps(torch.optim.Adagrad(model.parameters()))


def test_identity_maps_are_plain_gradient_inner_product() -> None:
    model, _ = trained("sgd", 1)
    batch = rows()
    got = GhostEngine(model).score(row_losses(model), batch, N_CAND, IdentityStepMaps(2.0)).utilities
    G = per_sample_grads(model, batch)
    want = sum(2.0 * (G[f"{n}.weight"][:N_CAND] * G[f"{n}.weight"][N_CAND:].mean(0)).flatten(1).sum(1) for n, _ in scored_layers(model))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-8)


def test_rows_must_hold_candidates_and_target_rows() -> None:
    model, opt = trained("sgd", 0)
    with pytest.raises(ValueError, match="≥ 1 target row"):
        GhostEngine(model).score(row_losses(model), rows(n=5), 5, OptimizerStepMaps(opt))


def test_score_windows_are_seeded_contiguous_slices() -> None:
    from selection_callbacks.scoring.windows import score_windows

    ids = torch.arange(60).view(3, 20)
    batch = {"input_ids": ids, "labels": ids + 1, "sample_id": torch.arange(3)}
    a = score_windows(batch, 6, torch.Generator().manual_seed(0))
    b = score_windows(batch, 6, torch.Generator().manual_seed(0))
    assert set(a) == {"input_ids", "labels"} and a["input_ids"].shape == (3, 6)
    assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["labels"], a["input_ids"] + 1)
    for r in range(3):
        start = int(a["input_ids"][r, 0])
        assert a["input_ids"][r].tolist() == list(range(start, start + 6)) and 20 * r <= start <= 20 * r + 14
    offsets = {tuple(score_windows(batch, 6, torch.Generator().manual_seed(s))["input_ids"][:, 0].tolist()) for s in range(20)}
    assert len(offsets) > 10
    assert score_windows(batch, 50, torch.Generator())["input_ids"] is ids


class _Twice(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(64, 16)
        self.lin = torch.nn.Linear(16, 16)
        self.head = torch.nn.Linear(16, 64)

    def forward(self, ids):
        return self.head(self.lin(self.lin(self.emb(ids))))


class _Flat(_Twice):
    def forward(self, ids):
        h = self.emb(ids)
        return self.head(self.lin(h.reshape(-1, 16)).reshape(h.shape))


def test_layer_called_twice_is_an_error_unless_excluded() -> None:
    model = _Twice()
    with pytest.raises(RuntimeError, match="ran twice in one forward"):
        GhostEngine(model, include_head=True).score(row_losses(model), rows(), N_CAND, IdentityStepMaps())
    got = GhostEngine(model, include_head=True, exclude=("lin",)).score(row_losses(model), rows(), N_CAND, IdentityStepMaps())
    assert set(got.layer_utilities) == {"head"}


def test_rows_must_stay_batch_first() -> None:
    model = _Flat()
    with pytest.raises(ValueError, match="batch-first"):
        GhostEngine(model).score(row_losses(model), rows(), N_CAND, IdentityStepMaps())


def test_biases_enter_sketches_and_norms() -> None:
    model, opt = trained("sgd", 2, bias=True)
    batch, resolver = rows(), OptimizerStepMaps(opt)
    got = GhostEngine(model, norms=True, sketch_dim=256, sketch="count").score(row_losses(model), batch, N_CAND, resolver)
    _, gram = brute_force(model, batch, resolver, scored_layers(model))
    torch.testing.assert_close(got.sq_norms, gram.diagonal(), rtol=1e-4, atol=0)


def test_adamw_map_stays_bounded_on_unseen_embedding_rows() -> None:
    model, opt = trained("adamw", 0)
    gbar = torch.zeros_like(model.wte.weight)
    gbar[:3] = 1e-3  # the target rows touch three rows only
    P = OptimizerStepMaps(opt)([model.wte.weight], gbar[None])
    scale = P.C * P.D[0]
    # untouched rows are capped by the tensor floor: 1/√(0.01·mean v) instead of lr/ε (~1e5 × the touched rows)
    assert float(scale.max() / scale.min()) == pytest.approx((1 / (0.01 * 3 / 64)) ** 0.5, rel=1e-3)


def test_layer_patterns_score_a_subset_with_the_same_utilities() -> None:
    from selection_callbacks.methods.bases.ghost import excluded_layers

    model, opt = trained("muon")
    full = GhostEngine(model).score(row_losses(model), rows(), N_CAND, OptimizerStepMaps(opt))
    exclude = excluded_layers(model, False, False, ["blocks.1.*"])
    assert exclude == ("blocks.0.attn.qkv", "blocks.0.attn.proj", "blocks.0.mlp.fc", "blocks.0.mlp.proj")
    late = GhostEngine(model, exclude=exclude).score(row_losses(model), rows(), N_CAND, OptimizerStepMaps(opt))
    assert set(late.layer_utilities) == {n for n in full.layer_utilities if n.startswith("blocks.1.")}
    for name, u in late.layer_utilities.items():
        torch.testing.assert_close(u, full.layer_utilities[name])
    assert excluded_layers(model, False, False, None) == ()
    with pytest.raises(ValueError, match=r"match none of the scorable layers: \['blocks.0.attn.qkv'"):
        excluded_layers(model, False, False, ["block.*"])


@pytest.mark.parametrize("shape", [(128, 512), (384, 128), (64, 64)])
def test_muon_factor_equals_the_explicit_iteration(shape) -> None:
    u = torch.randn(*shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    a, b, c = (3.4445, -4.7750, 2.0315)
    x = (u.T if shape[0] > shape[1] else u) / u.norm()
    x0 = x.clone()
    for _ in range(5):  # the textbook iteration on the d×n matrix, in float64
        A = x @ x.T
        x = (a * torch.eye(A.shape[0], dtype=A.dtype) + b * A + c * A @ A) @ x
    L, norm, tall = newton_schulz_left_factor(u, (a, b, c), 5, 1e-7)  # the accelerators' factor
    assert float((L.double() @ x0 - x).norm() / x.norm()) < 1e-4
    L = NewtonSchulz((a, b, c), 5, 1e-7).spectral(u).L  # the CPU's, from the eigendecomposition
    assert float((L.double() @ x0 - x).norm() / x.norm()) < 1e-5


@pytest.mark.parametrize("opt_name,sketch", [("adamw", "tensor"), ("adamw", "count"), ("muon", "tensor"), ("sgd", "two_sided")])
def test_candidate_chunks_give_the_one_pass_scores(opt_name: str, sketch: str) -> None:
    """Candidate chunks, the target rows riding with the first (flat activation memory) = one pass over all rows."""
    model, opt = trained(opt_name, bias=opt_name == "sgd")
    embedding = sketch != "two_sided"
    batch, resolver = rows(n=11 + N_TARGET), OptimizerStepMaps(opt)
    kwargs = dict(include_embedding=embedding, include_head=True, sketch_dim=256, sketch=sketch, norms=True)
    one = GhostEngine(model, **kwargs).score(row_losses(model), batch, 11, resolver, seed=3)
    for chunk in (1, 4, 11):
        got = GhostEngine(model, candidate_chunk=chunk, **kwargs).score(row_losses(model), batch, 11, resolver, seed=3)
        for field in ("utilities", "losses", "sketches", "sq_norms"):
            ref = getattr(one, field)  # float32 sums in another order: tolerance relative to the largest entry
            torch.testing.assert_close(getattr(got, field), ref, rtol=1e-5, atol=1e-7 * max(1.0, float(ref.abs().max())))
        assert got.layer_utilities.keys() == one.layer_utilities.keys()
        assert got.factor_error.keys() == one.factor_error.keys()
    with pytest.raises(ValueError, match="candidate_chunk must be ≥ 1"):
        GhostEngine(model, candidate_chunk=0)


@pytest.mark.parametrize("opt_name", ["adamw", "muon"])
def test_layers_group_only_within_one_optimizer_group(opt_name: str) -> None:
    """blocks.0 trains in its own group (another lr): its layers get their own grouped maps, still exact."""
    model, _ = trained("sgd", 0)
    first = [p for n, p in model.named_parameters() if n.startswith("blocks.0.") and p.ndim == 2]
    rest = [p for n, p in model.named_parameters() if not (n.startswith("blocks.0.") and p.ndim == 2)]
    if opt_name == "adamw":
        opt = torch.optim.AdamW([{"params": first, "lr": 1e-2}, {"params": rest, "lr": 1e-3}])
    else:
        opt = torch.optim.Muon([{"params": first, "lr": 5e-2}, {"params": [p for p in rest if p.ndim == 2], "lr": 1e-2}])
    for _ in range(2):
        ids = torch.randint(0, 64, (8, T + 1))
        opt.zero_grad()
        row_losses(model)({"input_ids": ids[:, :-1], "labels": ids[:, 1:]}).mean().backward()
        opt.step()
    batch, resolver = rows(), OptimizerStepMaps(opt)
    got = GhostEngine(model).score(row_losses(model), batch, N_CAND, resolver)
    want, _ = brute_force(model, batch, resolver, scored_layers(model))
    torch.testing.assert_close(got.utilities, want, rtol=1e-4, atol=1e-6 * float(want.abs().max()))


def test_same_shaped_layers_with_and_without_bias_are_scored_apart() -> None:
    """Two 8×8 linears, one with a bias: both exact against per-row autograd gradients."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 8, bias=True), torch.nn.Tanh(), torch.nn.Linear(8, 8, bias=False))
    x = torch.randn(N_CAND + N_TARGET, 4, 8)

    def losses(batch):
        return net(batch["input_ids"]).pow(2).mean((1, 2))

    got = GhostEngine(net).score(losses, {"input_ids": x}, N_CAND, IdentityStepMaps())
    grads = [torch.autograd.grad(losses({"input_ids": x[i : i + 1]}).sum(), list(net.parameters())) for i in range(len(x))]
    gbar = [torch.stack([g[k] for g in grads[N_CAND:]]).mean(0) for k in range(3)]
    want = torch.stack([sum((g[k] * gbar[k]).sum() for k in range(3)) for g in grads[:N_CAND]])
    torch.testing.assert_close(got.utilities, want, rtol=1e-4, atol=1e-7)


def test_same_shaped_layers_on_different_token_counts_are_scored_apart() -> None:
    """A pooler-like Linear on one token beside a same-shaped Linear on all tokens: not grouped, both exact."""
    torch.manual_seed(0)
    body, pool = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
    x = torch.randn(N_CAND + N_TARGET, 5, 8)

    def losses(batch):
        h = torch.tanh(body(batch["input_ids"]))
        return pool(h[:, 0]).pow(2).mean(1) + h.pow(2).mean((1, 2))

    got = GhostEngine(torch.nn.ModuleDict({"body": body, "pool": pool})).score(losses, {"input_ids": x}, N_CAND, IdentityStepMaps())
    params = [*body.parameters(), *pool.parameters()]
    grads = [torch.autograd.grad(losses({"input_ids": x[i : i + 1]}).sum(), params) for i in range(len(x))]
    gbar = [torch.stack([g[k] for g in grads[N_CAND:]]).mean(0) for k in range(4)]
    want = torch.stack([sum((g[k] * gbar[k]).sum() for k in range(4)) for g in grads[:N_CAND]])
    torch.testing.assert_close(got.utilities, want, rtol=1e-4, atol=1e-7)


def test_grouped_adamw_map_keeps_each_layers_step_and_amsgrad_state() -> None:
    """One grouped map over layers with different step counts and partial amsgrad state = the maps one by one."""
    model, _ = trained("sgd", 0)
    fc = [model.blocks[0].mlp.fc.weight, model.blocks[1].mlp.fc.weight]
    opt = torch.optim.AdamW(fc, lr=1e-2, betas=(0.9, 0.95), amsgrad=True)
    for step in range(3):  # shrinking gradients (so amsgrad's max matters); the second layer takes one step only
        fc[0].grad = torch.randn_like(fc[0]) * (10.0 if step == 0 else 0.01)
        fc[1].grad = torch.randn_like(fc[1]) if step == 0 else None
        opt.step()
    opt.state[fc[1]].pop("max_exp_avg_sq")  # as if it had never been stepped with amsgrad on
    gbar = torch.randn(2, *fc[0].shape)
    resolver = OptimizerStepMaps(opt)
    grouped = resolver(fc, gbar).apply(gbar)
    for i in range(2):
        torch.testing.assert_close(grouped[i], resolver([fc[i]], gbar[i : i + 1]).apply(gbar[i : i + 1])[0])


@pytest.mark.parametrize("group_layers", [False, True])
def test_layers_are_scored_inside_the_backward_and_release_their_captures(group_layers: bool, monkeypatch) -> None:
    """Each group is scored as its last b arrives: one by one, at most one layer's b is held at a time; grouped,
    the groups' scores still equal the ungrouped ones."""
    model, opt = trained("adamw")
    held, groups = [], []
    arrived, score_group = GhostEngine._arrived, GhostEngine._score_group

    def spy_arrived(self, name, grad, state):
        arrived(self, name, grad, state)
        held.append(len(state.grads))

    def spy_groups(self, names, state):
        groups.append(names)
        score_group(self, names, state)

    monkeypatch.setattr(GhostEngine, "_arrived", spy_arrived)
    monkeypatch.setattr(GhostEngine, "_score_group", spy_groups)
    batch, resolver = rows(), OptimizerStepMaps(opt)
    got = GhostEngine(model, group_layers=group_layers, sketch_dim=64).score(row_losses(model), batch, N_CAND, resolver)
    assert sorted(n for g in groups for n in g) == sorted(name for name, _ in scored_layers(model))
    if group_layers:
        assert max(map(len, groups)) == 2  # the two blocks' same-shaped layers
        want = GhostEngine(model, group_layers=False, sketch_dim=64).score(row_losses(model), batch, N_CAND, resolver)
        torch.testing.assert_close(got.utilities, want.utilities, rtol=1e-5, atol=1e-6 * float(want.utilities.abs().max()))
        torch.testing.assert_close(got.sketches, want.sketches, rtol=1e-4, atol=1e-5 * float(want.sketches.abs().max()))
    else:
        assert set(map(len, groups)) == {1} and max(held) == 0  # each b is scored and dropped on arrival


@pytest.mark.parametrize("optimizer, grouped", [("adamw", False), ("muon", True)])
def test_layers_group_by_default_on_accelerators_and_under_muon(monkeypatch, optimizer: str, grouped: bool) -> None:
    """group_layers=None: grouped on accelerators; on CPU only the layers Muon steps (its maps gain from a group),
    the others one by one."""
    monkeypatch.setattr(ghost, "group_by_default", GROUP_BY_DEFAULT)
    groups, score_group = [], GhostEngine._score_group
    monkeypatch.setattr(GhostEngine, "_score_group", lambda self, names, state: (groups.append(names), score_group(self, names, state)))
    model, opt = trained(optimizer)
    resolve = OptimizerStepMaps(opt)
    for _, module in scored_layers(model):
        assert GROUP_BY_DEFAULT(torch.device("cuda"), resolve, module.weight)
        assert GROUP_BY_DEFAULT(torch.device("cpu"), resolve, module.weight) is grouped
    GhostEngine(model).score(row_losses(model), rows(), N_CAND, resolve)
    assert set(map(len, groups)) == ({2} if grouped else {1})  # the two blocks' same-shaped layers


@pytest.mark.parametrize("pattern", [None, ["blocks.1.*"], ["blocks.1.mlp.*"]])
def test_backward_flops_are_those_the_scoring_backward_runs(pattern) -> None:
    """The layers the engine counts for its backward are the ones autograd really runs: the linear FLOPs of
    ``torch.autograd.grad`` from the loss to the earliest scored layer's input, counted by FlopCounterMode."""
    from torch.utils.flop_counter import FlopCounterMode

    from selection_callbacks.methods.bases.ghost import excluded_layers
    from selection_callbacks.nn.flops import matmul_flops_per_token

    model, opt = trained("adamw")
    engine = GhostEngine(model, exclude=excluded_layers(model, False, False, pattern))
    assert engine.backward_flops is None
    engine.score(row_losses(model), rows(), N_CAND, OptimizerStepMaps(opt))
    first = engine.layers[0][1]
    captured = []
    handle = first.register_forward_pre_hook(lambda module, args: captured.append(args[0]))
    batch = rows()
    loss = row_losses(model)(batch).sum()
    handle.remove()
    counter = FlopCounterMode(display=False)
    with counter:
        torch.autograd.grad(loss, captured[0])
    counts = counter.get_flop_counts()["Global"]
    linear = sum(n for op, n in counts.items() if op in (torch.ops.aten.mm, torch.ops.aten.addmm))
    tokens = batch["input_ids"].numel()
    assert linear == engine.backward_flops * tokens  # one activation-gradient product per reached layer: 2·d_in·d_out a token
    assert (engine.backward_flops == matmul_flops_per_token(model)) == (pattern is None)
