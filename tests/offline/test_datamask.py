"""DATAMASK: the Plackett–Luce gradient and the pairwise identity against brute force, the learning
loop on planted data, and the bench/CLI wrapper."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from selection_callbacks.data.subset import read_subset
from selection_callbacks.offline.common import quality
from selection_callbacks.offline.common.corpus import Budget, load_corpus
from selection_callbacks.offline.common.features import FeatureBank
from selection_callbacks.offline.datamask import selector as dm
from selection_callbacks.offline.select import run_selection


def planted(n: int = 800, d: int = 16, clusters: int = 8, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Half the documents in cluster 0, which also holds the high quality; the rest spread over 7 clusters."""
    r = np.random.default_rng(seed)
    centres = r.standard_normal((clusters, d))
    labels = np.where(r.random(n) < 0.5, 0, r.integers(1, clusters, n))
    x = centres[labels] + 0.3 * r.standard_normal((n, d))
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    quality = (labels == 0) + 0.5 * r.standard_normal(n)
    return quality, x.astype(np.float32), labels


def mean_pairwise_cosine(x: np.ndarray) -> float:
    c = x @ x.T
    return float((c.sum() - np.trace(c)) / (len(x) * (len(x) - 1)))


def sequential_log_prob(logits: torch.Tensor, order: list[int]) -> torch.Tensor:
    """log P(order) of drawing ``order`` one by one without replacement from softmax(logits)."""
    left = list(range(logits.shape[0]))
    total = logits.new_zeros(())
    for j in order:
        total = total + logits[j] - torch.logsumexp(logits[left], 0)
        left.remove(j)
    return total


@pytest.mark.parametrize("scale", [1.0, 30.0, 300.0])
def test_plackett_luce_grad_matches_autograd(scale: float) -> None:
    g = torch.Generator().manual_seed(0)
    logits = (scale * torch.randn(9, generator=g, dtype=torch.float64)).requires_grad_(True)
    orders = torch.stack([torch.randperm(9, generator=g)[:4] for _ in range(6)])
    weights = torch.randn(6, generator=g, dtype=torch.float64)
    sum(w * sequential_log_prob(logits, o.tolist()) for w, o in zip(weights, orders)).backward()
    got = dm.plackett_luce_grad(logits.detach(), orders, weights)
    assert torch.allclose(got, logits.grad, atol=1e-9, rtol=1e-9)


def test_plackett_luce_grad_whole_set_and_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(7, generator=g, dtype=torch.float64)
    orders = torch.stack([torch.randperm(7, generator=g) for _ in range(5)])  # S = n: nothing left undrawn
    weights = torch.randn(5, generator=g, dtype=torch.float64)
    x = logits.clone().requires_grad_(True)
    sum(w * sequential_log_prob(x, o.tolist()) for w, o in zip(weights, orders)).backward()
    monkeypatch.setattr(dm, "_ELEMENTS_PER_BLOCK", 14)  # two masks per block
    assert torch.allclose(dm.plackett_luce_grad(logits, orders, weights), x.grad, atol=1e-10)


def test_gumbel_top_s_draws_plackett_luce_orders() -> None:
    logits = torch.tensor([0.0, 1.0, -1.0, 0.5])
    orders = dm.gumbel_top_s(logits, 40_000, 2, np.random.default_rng(0))
    assert orders.shape == (40_000, 2) and bool((orders[:, 0] != orders[:, 1]).all())
    p = torch.softmax(logits.double(), 0)
    first = torch.bincount(orders[:, 0], minlength=4) / 40_000
    assert torch.allclose(first.double(), p, atol=0.01)
    pair = float(((orders[:, 0] == 1) & (orders[:, 1] == 3)).double().mean())
    assert abs(pair - float(p[1] * p[3] / (1 - p[1]))) < 0.01


def test_pairwise_identity_matches_brute_force() -> None:
    r = np.random.default_rng(0)
    x = r.standard_normal((50, 8))
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    x[7] = 0.0  # a zero row (e.g. an empty document) is handled by Σ‖x_i‖², not by assuming S
    table = torch.as_tensor(x)
    idx = torch.as_tensor(np.stack([r.choice(50, 12, replace=False) for _ in range(5)]))
    got = dm.pairwise_diversity(dm.mask_sums(idx, table), table.pow(2).sum(1)[idx].sum(1), 12)
    for g, rows in enumerate(idx.numpy()):
        c = x[rows] @ x[rows].T
        assert got[g].item() == pytest.approx(-(c.sum() - np.trace(c)) / (12 * 11), abs=1e-12)


def test_returns_the_budget_deterministically() -> None:
    quality, emb, _ = planted()
    kw = dict(iterations=30, groups=32, progress=False)
    a = dm.datamask(quality, emb, 77, seed=3, **kw)
    b = dm.datamask(quality, emb, 77, seed=3, **kw)
    c = dm.datamask(quality, emb, 77, seed=4, **kw)
    assert len(a.indices) == 77 == len(np.unique(a.indices)) and a.indices.max() < len(quality)
    assert np.array_equal(a.indices, b.indices) and np.array_equal(a.history, b.history)
    assert not np.array_equal(a.indices, c.indices)
    assert a.history.shape == (1, 30) and set(a.seconds) == {"prepare", "learn", "final"}


def test_objective_rises_over_iterations() -> None:
    quality, emb, _ = planted()
    for diversity in dm.DIVERSITIES:
        h = dm.datamask(quality, emb, 80, lam=0.3, iterations=200, groups=64, update_fraction=0.2,
                        diversity=diversity, progress=False).history[0]
        assert h[-40:].mean() > h[:40].mean() + 5 * h[-40:].std() / np.sqrt(40), diversity


def test_lambda_moves_between_quality_and_diversity() -> None:
    quality, emb, labels = planted()
    runs = {lam: dm.datamask(quality, emb, 80, lam=lam, iterations=200, groups=64, update_fraction=0.2,
                             progress=False).indices for lam in (0.0, 1.0)}
    centred = emb - emb[np.sort(np.argsort(-quality)[:480])].mean(0)  # the candidates after pruning 40%
    centred /= np.linalg.norm(centred, axis=1, keepdims=True)
    q = {lam: quality[i].mean() for lam, i in runs.items()}
    cos = {lam: mean_pairwise_cosine(centred[i]) for lam, i in runs.items()}
    assert q[1.0] > q[0.0] + 0.2
    assert cos[0.0] < cos[1.0] - 0.15
    assert (labels[runs[1.0]] == 0).mean() > 0.9 and (labels[runs[0.0]] == 0).mean() < 0.7  # cluster 0: the good one


def test_chunks_and_pruning() -> None:
    quality, emb, _ = planted(n=1000)
    res = dm.datamask(quality, emb, 101, prune=0.5, chunk_size=200, iterations=5, groups=8, progress=False)
    assert len(res.indices) == 101 and res.history.shape == (3, 5) and res.final_objective.shape == (3,)
    worst = np.argsort(quality)[:500]
    assert not np.isin(res.indices, worst).any() and np.isinf(res.logits[worst]).all()
    assert np.isfinite(np.delete(res.logits, worst)).all()
    # pruning never leaves fewer than S candidates
    assert len(dm.datamask(quality, emb, 900, prune=0.5, iterations=2, groups=4, progress=False).indices) == 900


def test_full_updates_and_whole_pool() -> None:
    quality, emb, _ = planted(n=100)
    res = dm.datamask(quality, emb, 100, prune=0.0, update_fraction=1.0, iterations=3, groups=4, progress=False)
    assert np.array_equal(res.indices, np.arange(100))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(budget=0), "budget"),
        (dict(budget=101), "budget"),
        (dict(lam=1.5), "lam"),
        (dict(lam=-0.1), "lam"),
        (dict(prune=1.0), "prune"),
        (dict(update_fraction=0.0), "update_fraction"),
        (dict(groups=1), "groups"),
        (dict(diversity="disf"), "diversity"),
    ],
)
def test_clear_errors(kwargs: dict, match: str) -> None:
    quality, emb, _ = planted(n=100)
    args = dict(budget=10) | kwargs
    with pytest.raises(ValueError, match=match):
        dm.datamask(quality, emb, args.pop("budget"), progress=False, **args)


def test_clear_errors_on_inputs() -> None:
    quality, emb, _ = planted(n=100)
    with pytest.raises(ValueError, match="non-empty"):
        dm.datamask(np.zeros(0), np.zeros((0, 4), dtype=np.float32), 1)
    with pytest.raises(ValueError, match="embeddings must be"):
        dm.datamask(quality, emb[:50], 10)
    bad = emb.copy()
    bad[3, 0] = np.nan
    with pytest.raises(ValueError, match="non-finite"):
        dm.datamask(quality, bad, 10, progress=False)


def test_selector_meets_document_and_token_budgets(tiny_corpus, tmp_path: Path) -> None:
    cfg = dm.DatamaskConfig(lam=1.0, iterations=40, quality="heuristic", embedder="hashed")
    out = tmp_path / "docs.parquet"
    summary = run_selection("datamask", tiny_corpus["pool"], tiny_corpus["target"], Budget(docs=60), 0, out, cfg,
                            progress=False)
    assert json.loads(Path(f"{out}.summary.json").read_text())["documents"] == 60
    assert len(read_subset(out).ids) == 60 == summary["documents"]
    assert summary["domains"]["prose"]["docs"] > 0.8 * 60  # the pool: half prose, half noise

    pool = load_corpus(tiny_corpus["pool"])
    for tokens in (20_000, int(pool.n_tokens.sum()) - 10):  # the second reaches into the pruned documents
        sel = dm.select_datamask(pool, load_corpus(tiny_corpus["target"]), Budget(tokens=tokens), 1,
                                 dataclasses.replace(cfg, lam=0.3), progress=False)
        got = pool.n_tokens[sel.indices].sum()
        assert np.unique(sel.indices).size == sel.indices.size
        assert tokens <= got < tokens + pool.n_tokens[sel.indices[-1]]
    with pytest.raises(ValueError, match="quality"):
        dm.select_datamask(pool, pool, Budget(docs=5), 0, dataclasses.replace(cfg, quality="llm"), progress=False)


def test_bank_quality_signs() -> None:
    cols = {"dsir": np.array([1.0, 0.0, 0.0]), "grad_align": np.array([0.2, 0.0, 0.0]),
            "distinct_3": np.array([0.9, 0.9, 0.1]), "non_ascii": np.array([0.0, 0.0, 0.0])}
    bank = FeatureBank(ids=np.array(["a", "b", "c"]), domains=np.array(["x"] * 3), columns=cols, meta={})
    q = quality.bank_quality(bank)
    assert q[0] > q[1] > q[2]


def test_text_heuristics_flag_repetition_and_noise() -> None:
    texts = ["the model reads data and learns which tokens follow", "abab" * 200, "Ǜ∂ßƒ©˙∆˚¬…æ" * 5]
    h = quality.text_heuristics(texts)
    assert h[0, 0] > 0.9 > 0.1 > h[1, 0]
    assert h[0, 1] > 0.9 > 0.1 > h[2, 1]
