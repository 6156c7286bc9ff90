"""The one Gumbel-top-k: the helpers draw Plackett–Luce orders, and every sampling site is the helper."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from selection_callbacks.core import sampling
from selection_callbacks.core.sampling import GumbelTopK, SequentialBoltzmann, gumbel_keys, gumbel_noise, gumbel_order
from selection_callbacks.offline.autodata.evaluation import FeatureTable, rule_order
from selection_callbacks.offline.autodata.schema import FEATURES, validate_recipe
from selection_callbacks.offline.common import corpus
from selection_callbacks.offline.datamask import selector as datamask

SCORES = np.array([1.2, 0.3, -0.4, 0.9])
DRAWS = 40_000


def plackett_luce_pairs(scores: np.ndarray) -> dict[tuple[int, int], float]:
    """P(first draw i, second draw j) of sampling without replacement ∝ exp(scores), by enumeration."""
    w = np.exp(scores)
    return {(i, j): w[i] / w.sum() * w[j] / (w.sum() - w[i]) for i, j in itertools.permutations(range(len(w)), 2)}


def pair_frequencies(orders: np.ndarray) -> dict[tuple[int, int], float]:
    """Empirical frequency of each (first, second) prefix among orders [draws, n]."""
    firsts, seconds = orders[:, 0], orders[:, 1]
    return {pair: float(np.mean((firsts == pair[0]) & (seconds == pair[1]))) for pair in plackett_luce_pairs(SCORES)}


def assert_plackett_luce(orders: np.ndarray, temperature: float) -> None:
    expected = plackett_luce_pairs(SCORES / temperature)
    got = pair_frequencies(orders)
    for pair, p in expected.items():
        assert abs(got[pair] - p) < 0.012, (pair, got[pair], p)


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
@pytest.mark.parametrize("scale_noise", [False, True])
def test_numpy_keys_order_like_plackett_luce(temperature: float, scale_noise: bool) -> None:
    scores = np.broadcast_to(SCORES, (DRAWS, SCORES.size))
    keys = gumbel_keys(scores, np.random.default_rng(0), temperature, scale_noise=scale_noise)
    assert keys.shape == scores.shape and keys.dtype == np.float64
    assert_plackett_luce(np.argsort(-keys, axis=1, kind="stable"), temperature)


def test_gumbel_order_is_the_stable_descending_order_of_the_keys() -> None:
    for seed in range(5):
        keys = gumbel_keys(SCORES, np.random.default_rng(seed), 0.7)
        assert np.array_equal(gumbel_order(SCORES, np.random.default_rng(seed), 0.7), np.argsort(-keys, kind="stable"))
    # τ = 1 is exactly scores + G either way; -inf comes last
    a = gumbel_keys(SCORES, np.random.default_rng(3))
    assert np.array_equal(a, gumbel_keys(SCORES, np.random.default_rng(3), 1.0, scale_noise=True))
    assert np.array_equal(a, SCORES + np.random.default_rng(3).gumbel(size=SCORES.size))
    assert gumbel_order(np.array([0.0, -np.inf, 5.0]), np.random.default_rng(0))[-1] == 1


@pytest.mark.parametrize("source", ["torch", "numpy"])
def test_torch_noise_orders_like_plackett_luce(source: str) -> None:
    generator = torch.Generator().manual_seed(0) if source == "torch" else np.random.default_rng(0)
    noise = gumbel_noise((DRAWS, SCORES.size), generator)
    assert noise.dtype == torch.float64 and bool(torch.isfinite(noise).all())
    keys = torch.from_numpy(SCORES)[None, :] + noise
    assert_plackett_luce(torch.sort(keys, dim=1, descending=True, stable=True).indices.numpy(), 1.0)
    assert gumbel_noise((3,), torch.Generator().manual_seed(0), torch.float32).dtype == torch.float32
    assert gumbel_noise((3,), np.random.default_rng(0), torch.float32).dtype == torch.float32


def test_torch_noise_is_minus_log_of_exponentials() -> None:
    u = torch.rand(64, generator=torch.Generator().manual_seed(4), dtype=torch.float64).clamp_(1e-12, 1 - 1e-12)
    assert torch.equal(gumbel_noise((64,), torch.Generator().manual_seed(4)), -torch.log(-torch.log(u)))
    e = np.random.default_rng(4).standard_exponential(64, dtype=np.float32)
    assert torch.equal(gumbel_noise((64,), np.random.default_rng(4), torch.float32), -torch.log(torch.from_numpy(e)))


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_online_rules_are_the_helper() -> None:
    scores = torch.randn(30, generator=gen(0))
    for tau in (0.3, 1.0, 4.0):
        keys = scores.double() / tau + gumbel_noise((30,), gen(1))
        expected = torch.sort(keys, descending=True, stable=True).indices[:7]
        assert torch.equal(GumbelTopK(tau).select(scores, 7, gen(1)), expected)
        # the first sequential draw without interactions is the Gumbel argmax of the scores / τ
        first = (scores.double() / tau + gumbel_noise((1, 30), gen(2)))[0].argmax()
        assert SequentialBoltzmann(tau).select(scores, 1, gen(2))[0] == first


def test_offline_sites_are_the_helper() -> None:
    assert corpus.gumbel_order is sampling.gumbel_order
    logits = torch.randn(50, generator=gen(3))
    keys = gumbel_noise((9, 50), np.random.default_rng(5), torch.float32).add_(logits)
    expected = torch.topk(keys, 6, dim=1, sorted=True).indices
    assert torch.equal(datamask.gumbel_top_s(logits, 9, 6, np.random.default_rng(5)), expected)


def test_recipe_rules_are_the_helper() -> None:
    n = 60
    rng = np.random.default_rng(0)
    table = FeatureTable({f: rng.normal(size=n) for f in FEATURES},
                         {"cluster": np.zeros(n, dtype=np.int64), "length_bin": np.zeros(n, dtype=np.int64)},
                         rng.integers(10, 100, n))
    s, candidates = rng.normal(size=n), np.sort(rng.choice(n, 40, replace=False))
    gumbel = validate_recipe({"terms": [{"feature": FEATURES[0]}], "rule": {"kind": "gumbel", "temperature": 0.4}})
    assert np.array_equal(rule_order(gumbel, s, candidates, table, np.random.default_rng(7)),
                          candidates[gumbel_order(s[candidates], np.random.default_rng(7), 0.4)])
    # one cell: the quota order is the descending order of s + τ·G
    quota = validate_recipe({"terms": [{"feature": FEATURES[0]}], "rule": {"kind": "quota", "temperature": 0.4}})
    keys = gumbel_keys(s[candidates], np.random.default_rng(8), 0.4, scale_noise=True)
    assert np.array_equal(rule_order(quota, s, candidates, table, np.random.default_rng(8)),
                          candidates[np.argsort(-keys, kind="stable")])
