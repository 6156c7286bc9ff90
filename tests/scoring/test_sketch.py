"""Sketches: unbiased inner products, error decaying at the rate theory gives (m ≤ dim/16)."""

from __future__ import annotations

import math

import pytest
import torch

from selection_callbacks.scoring.sketch import CountSketch, TensorSketch, TwoSidedProjection, sketch_blocks

N, D_OUT, D_IN, SEEDS = 4, 64, 64, 150  # dim = 4096, m up to 256 = dim/16
MS = (16, 64, 256)


def factors(aligned: bool, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    if aligned:  # similar per-sample gradients, as in a real superbatch
        b = torch.randn(1, tokens, D_OUT, generator=g) + 0.3 * torch.randn(N, tokens, D_OUT, generator=g)
        a = torch.randn(1, tokens, D_IN, generator=g) + 0.3 * torch.randn(N, tokens, D_IN, generator=g)
        return b, a
    return torch.randn(N, tokens, D_OUT, generator=g), torch.randn(N, tokens, D_IN, generator=g)


def sketch(kind: str, m: int, seed: int, b: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    if kind == "tensor":
        return TensorSketch(m, D_OUT, D_IN, seed, [0], torch.device("cpu"))(b[None], a[None])
    if kind == "count":
        return CountSketch(m, D_OUT, D_IN, seed, [0], torch.device("cpu"))(torch.einsum("nto,nti->noi", b, a)[None])
    return TwoSidedProjection(m, D_OUT, D_IN, seed, [0], torch.device("cpu"))(b[None], a[None])


def error_curve(kind: str, aligned: bool, tokens: int) -> tuple[list[float], float]:
    b, a = factors(aligned, tokens)
    G = torch.einsum("nto,nti->noi", b, a)
    true = torch.einsum("noi,moi->nm", G, G)
    norm = true.diagonal().sqrt()
    iu = torch.triu_indices(N, N, 1)
    errors, worst_z = [], 0.0
    for m in MS:
        est = torch.stack([(lambda s: s @ s.T)(sketch(kind, m, seed, b, a)) for seed in range(SEEDS)])
        z = (est.mean(0) - true) / (est.std(0) / math.sqrt(SEEDS))
        worst_z = max(worst_z, float(z[iu[0], iu[1]].abs().max()))
        rel = (est - true).pow(2).mean(0).sqrt() / torch.outer(norm, norm)
        errors.append(float(rel[iu[0], iu[1]].mean()))
    return errors, worst_z


def slope(errors: list[float]) -> float:
    return math.log(errors[-1] / errors[0]) / math.log(MS[-1] / MS[0])


@pytest.mark.parametrize("kind", ["tensor", "count"])
@pytest.mark.parametrize("aligned", [False, True])
def test_hash_sketches_unbiased_with_inverse_sqrt_m_error(kind: str, aligned: bool) -> None:
    errors, z = error_curve(kind, aligned, tokens=8)
    assert z < 4.5  # unbiased: the mean over seeds sits within sampling error of the truth
    assert -0.62 < slope(errors) < -0.38  # error ~ m^(-1/2)


def test_two_sided_projection_is_unbiased_but_slower_on_aligned_low_rank() -> None:
    errors, z = error_curve("two_sided", aligned=True, tokens=1)
    assert z < 4.5
    assert -0.35 < slope(errors) < -0.15  # ~ m^(-1/4): each side only has √m rows
    tensor_errors, _ = error_curve("tensor", aligned=True, tokens=1)
    assert errors[-1] > 2 * tensor_errors[-1]


def test_two_sided_needs_a_square_dimension() -> None:
    with pytest.raises(ValueError, match="square"):
        TwoSidedProjection(200, 8, 8, 0, [0], torch.device("cpu"))


@pytest.mark.parametrize("cls", [TensorSketch, CountSketch, TwoSidedProjection])
def test_grouped_layers_sketch_to_the_sum_of_their_own_sketches(cls) -> None:
    """L layers grouped (one kernel per group) = Σ over the layers sketched one by one, each with its own hashes."""
    b, a = factors(aligned=False, tokens=3)
    b2, a2 = b.flip(0) * 0.5, a.roll(1, 0)
    cpu = torch.device("cpu")

    scale = torch.rand(2, D_OUT, generator=torch.Generator().manual_seed(2))  # per-layer factors folded into b

    def run(layers, bs, as_, sc):
        sk = cls(64, D_OUT, D_IN, 7, layers, cpu)
        if cls is CountSketch:
            return sk(torch.einsum("lnto,lnti->lnoi", bs * sc[:, None, None, :], as_))
        return sk(bs, as_, sc, None)

    grouped = run([3, 5], torch.stack([b, b2]), torch.stack([a, a2]), scale)
    one_by_one = run([3], b[None], a[None], scale[:1]) + run([5], b2[None], a2[None], scale[1:])
    assert float(grouped.norm()) > 0
    torch.testing.assert_close(grouped, one_by_one, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("block, m, layers, offsets", [(None, 64, [0, 1], None), (16, 64, [0, 2], [0, 32]), (7, 40, [2, 4], [30, 9])])
def test_tensor_sketch_is_the_count_sketch_of_its_hash(block, m, layers, offsets) -> None:
    """Exactly (not just in expectation) the CountSketch of the scaled Σ_t b aᵀ under (h1(o) + h2(i)) mod n, each
    layer in its own block of n bins (or, without blocks, all layers over all m bins)."""
    g = torch.Generator().manual_seed(4)
    b, a = torch.randn(2, N, 5, D_OUT, generator=g), torch.randn(2, N, 5, D_IN, generator=g)
    scale_b, scale_a = torch.rand(2, D_OUT, generator=g), torch.rand(2, 1, generator=g)
    ts = TensorSketch(m, D_OUT, D_IN, 3, layers, torch.device("cpu"), block=block, offsets=offsets)
    G = torch.einsum("lnto,lnti->lnoi", b * scale_b[:, None, None], a * scale_a[:, None, None]).flatten(2)
    bins, signs = ts.explicit()
    want = torch.zeros(N, m)
    for layer in range(2):
        want.index_add_(1, bins[layer], G[layer] * signs[layer])
    got = ts(b, a, scale_b, scale_a)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))
    if block:  # nothing outside the layers' blocks
        used = torch.zeros(m, dtype=torch.bool)
        used[bins.flatten()] = True
        assert int(used.sum()) <= 2 * block and torch.equal(got[:, ~used], torch.zeros(N, int((~used).sum())))


def test_tensor_sketch_blocks_must_fit() -> None:
    with pytest.raises(ValueError, match="do not fit"):
        TensorSketch(40, D_OUT, D_IN, 0, [5], torch.device("cpu"), block=8, offsets=[35])


def test_sketch_blocks_split_the_bins_by_layer_size() -> None:
    assert sketch_blocks([300, 100, 100], 10) == [(0, 6), (6, 2), (8, 2)]
    assert sketch_blocks([64, 64], 33) == [(0, 16), (16, 16)]  # same-sized layers get equal blocks (groupable)
    with pytest.raises(ValueError, match="no bin of its own"):
        sketch_blocks([1000, 1], 50)
