"""Offline selectors on the tiny corpus: exact budgets, seeds, DSIR's target match, warmup-delta
trimming, the policy's learning signal and parallel rollouts, and the CLI into the datamodule."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math

import numpy as np
import pytest
import torch

from selection_callbacks.data.datamodule import PoolDataModule
from selection_callbacks.data.subset import read_subset
from selection_callbacks.offline.common.corpus import Budget, SelectionError, load_corpus
from selection_callbacks.offline.common.features import FeatureBank
from selection_callbacks.offline.dsir.selector import DSIRConfig, select_dsir
from selection_callbacks.offline.policy.selector import (
    PolicyConfig,
    learn_policy,
    plackett_luce_log_prob,
    select_policy,
)
from selection_callbacks.offline.select import SELECTORS, main, run_selection
from selection_callbacks.offline.warmup_delta import selector as warmup_delta_mod
from selection_callbacks.offline.warmup_delta.selector import WarmupDeltaConfig, delta_order, select_warmup_delta
from tests.offline.test_offline_features import TINY_BANK, TINY_PROXY

TINY_POLICY = PolicyConfig(
    group_size=3, rounds=2, rollout_tokens=2048, rollout_proxy=TINY_PROXY, reward_windows=8, noise_repeats=2,
    bank=TINY_BANK,
)


@pytest.fixture(scope="module")
def corpora(tiny_corpus):
    return load_corpus(tiny_corpus["pool"]), load_corpus(tiny_corpus["target"], "target")


def _exact(pool, budget: Budget, idx: np.ndarray) -> bool:
    return len(set(idx.tolist())) == idx.size and np.array_equal(budget.take(idx, pool.n_tokens), idx)


def test_dsir_picks_target_like_documents(corpora) -> None:
    pool, target = corpora
    budget = Budget(tokens=int(pool.n_tokens.sum()) // 4)
    a, b, c = (select_dsir(pool, target, budget, s, DSIRConfig(), progress=False).indices for s in (0, 0, 1))
    assert _exact(pool, budget, a)
    np.testing.assert_array_equal(a, b)
    assert set(a.tolist()) != set(c.tolist())
    base = (pool.domains == "prose").mean()
    assert base < 0.6 and (pool.domains[a] == "prose").mean() >= 0.95  # the target is prose only


def _planted_bank(pool) -> tuple[FeatureBank, np.ndarray, np.ndarray]:
    """Δ ~ N(1, 0.1) with three documents planted at Δ = +10 and three at Δ = −10."""
    delta = np.random.default_rng(0).normal(1.0, 0.1, len(pool))
    top, bottom = np.array([5, 50, 100]), np.array([7, 70, 170])
    delta[top], delta[bottom] = 10.0, -10.0
    return FeatureBank(pool.ids, pool.domains, {"delta": delta}, {}), top, bottom


def test_warmup_delta_trimming_removes_planted_extremes(corpora, monkeypatch) -> None:
    pool, target = corpora
    bank, top, bottom = _planted_bank(pool)
    monkeypatch.setattr(warmup_delta_mod, "feature_bank", lambda *a, **k: bank)
    budget = Budget(docs=10)
    untrimmed = select_warmup_delta(pool, target, budget, 0, WarmupDeltaConfig(0.0, 0.0), progress=False).indices
    trimmed = select_warmup_delta(pool, target, budget, 0, WarmupDeltaConfig(2.0, 2.0), progress=False).indices
    assert set(top) <= set(untrimmed.tolist())  # plain top-K takes the planted top tail first
    assert not set(top) & set(trimmed.tolist())
    assert np.all(bank.columns["delta"][trimmed] < 2.0) and _exact(pool, budget, trimmed)
    # the bottom tail is never eligible once trimmed, and ranked last otherwise
    assert not set(bottom) & set(delta_order(bank.columns["delta"], 2.0, 2.0).tolist())
    assert set(delta_order(bank.columns["delta"], 0.0, 0.0)[-3:].tolist()) == set(bottom)
    with pytest.raises(ValueError, match="trim percentiles"):
        delta_order(bank.columns["delta"], 60.0, 50.0)


def test_warmup_delta_with_a_real_proxy(corpora) -> None:
    pool, target = corpora
    budget = Budget(tokens=20_000)
    cfg = WarmupDeltaConfig(bank=TINY_BANK)
    runs = [select_warmup_delta(pool, target, budget, s, cfg, progress=False) for s in (0, 1)]
    np.testing.assert_array_equal(runs[0].indices, runs[1].indices)  # top-K: the seed plays no part
    assert _exact(pool, budget, runs[0].indices)
    lo, hi = runs[0].info["chosen_delta_range"]
    assert lo <= hi


def test_plackett_luce_log_prob_matches_enumeration() -> None:
    s = torch.tensor([0.3, -1.0, 2.0, 0.5], dtype=torch.float64)
    p = torch.softmax(s, 0)
    for picked in itertools.permutations(range(4), 2):
        left, prob = list(range(4)), 1.0
        for i in picked:
            prob *= float(p[i] / p[left].sum())
            left.remove(i)
        assert float(plackett_luce_log_prob(s, torch.tensor(picked))) == pytest.approx(math.log(prob))


def test_policy_weights_move_toward_the_informative_feature() -> None:
    """Reward = mean of feature 2 over the subset (plus noise): its weight must dominate."""
    z = np.random.default_rng(0).normal(size=(300, 4))

    def reward(subsets, seeds):
        noise = [np.random.default_rng(seed + i).normal(0, 0.02) for i, seed in enumerate(seeds)]
        return np.asarray([z[s, 2].mean() + e for s, e in zip(subsets, noise)])

    result = learn_policy(z, np.full(300, 100), Budget(docs=30), reward, 0, group_size=8, rounds=40, progress=False)
    w = result.weights
    assert w[2] > 1.0 and w[2] > 4 * np.abs(np.delete(w, 2)).max()
    assert result.history[-1]["reward_mean"] > result.history[0]["reward_mean"] + 0.5


def test_policy_production_path_parallel_rollouts_and_seeds(corpora) -> None:
    pool, target = corpora
    budget = Budget(tokens=15_000)
    serial = select_policy(pool, target, budget, 0, TINY_POLICY, progress=False)
    parallel = select_policy(pool, target, budget, 0, dataclasses.replace(TINY_POLICY, workers=2), progress=False)
    other = select_policy(pool, target, budget, 1, TINY_POLICY, progress=False)
    np.testing.assert_array_equal(serial.indices, parallel.indices)
    assert serial.info["weights"] == parallel.info["weights"]
    assert set(serial.indices.tolist()) != set(other.indices.tolist())
    assert _exact(pool, budget, serial.indices)
    info = serial.info
    assert list(info["weights"]) == list(TINY_POLICY.features) and any(v != 0 for v in info["weights"].values())
    assert info["rollouts"] == 3 * 2 + 2 and info["reward_noise_std"] >= 0.0
    assert all(h["reward_mean"] < 0 for h in info["rounds"])  # reward = −target loss


def test_cli_writes_a_subset_the_datamodule_trains_on(tiny_corpus, tmp_path, capsys) -> None:
    out = tmp_path / "dsir.parquet"
    common = ["--pool", tiny_corpus["pool"], "--target", tiny_corpus["target"], "--progress", "false"]
    summary = main(["dsir", *common, "--budget-tokens=20000", "--seed=3", f"--out={out}", "--num_buckets=4096"])
    printed = capsys.readouterr().out
    assert "[select] dsir (seed 3)" in printed and "prose" in printed
    assert json.loads((tmp_path / "dsir.parquet.summary.json").read_text()) == summary
    assert summary["config"]["num_buckets"] == 4096 and summary["tokens"] >= 20000
    assert summary["domains"]["prose"]["token_share"] > 0.9
    assert set(summary["length_tokens_quantiles"]) == {"0.0", "0.1", "0.5", "0.9", "1.0"}
    subset = read_subset(out)
    assert subset.kind == "doc_id" and len(subset.ids) == summary["documents"]
    dm = PoolDataModule(tiny_corpus["pool"], tiny_corpus["target"], tiny_corpus["val"], seq_len=32, batch_size=4,
                        ratio=1.0, subset=str(out), progress=False)
    dm.prepare_data()
    dm.setup("fit")
    assert sorted(dm.splits["pool"].doc_ids.tolist()) == sorted(subset.ids)
    assert next(iter(dm.train_dataloader()))["input_ids"].shape == (4, 32)
    # warmup delta through the CLI, with the tiny bank's settings (a cache hit after the tests above)
    p = TINY_PROXY
    keys = ("n_layer", "n_head", "n_embd", "seq_len", "batch_size", "lr")
    bank_flags = [f"--bank.proxy.{k}={getattr(p, k)}" for k in keys]
    bank_flags += ["--bank.score_tokens=256", "--bank.clusters=4", "--bank.dsir.num_buckets=2048"]
    summary = main(["warmup_delta", *common, "--budget-docs", "12", "--out", str(tmp_path / "wd.parquet"), *bank_flags])
    assert summary["documents"] == 12 and len(read_subset(tmp_path / "wd.parquet").ids) == 12


def test_clear_errors(tiny_corpus, tmp_path) -> None:
    args = (tiny_corpus["pool"], tiny_corpus["target"])
    with pytest.raises(SelectionError, match="unknown selection method 'nope'; available: dsir, warmup_delta, policy"):
        run_selection("nope", *args, Budget(docs=1), 0, tmp_path / "x.parquet")
    with pytest.raises(SelectionError, match="larger than the pool"):
        run_selection("dsir", *args, Budget(docs=10_000), 0, tmp_path / "x.parquet")
    with pytest.raises(SystemExit):
        main(["nope", "--pool", args[0], "--target", args[1], "--budget-docs", "1", "--out", "x.parquet"])
    with pytest.raises(SystemExit):  # both budgets
        main(["dsir", "--pool", args[0], "--target", args[1], "--budget-docs=1", "--budget-tokens=9", "--out=x"])
    assert set(SELECTORS) >= {"dsir", "warmup_delta", "policy"}


def test_offline_oracle_takes_the_targets_domains_first_up_to_the_budget(corpora) -> None:
    from selection_callbacks.offline.oracle.selector import OracleConfig, select_oracle

    pool, target = corpora
    inside = pool.domains == "prose"  # the tiny target is prose
    in_tokens = int(pool.n_tokens[inside].sum())
    for tokens in (in_tokens // 2, in_tokens + 500):
        budget = Budget(tokens=tokens)
        sel = select_oracle(pool, target, budget, seed=0, cfg=OracleConfig())
        idx = sel.indices
        assert _exact(pool, budget, idx) and sel.info["target_domains"] == ["prose"]
        first_out = np.flatnonzero(~inside[idx])
        # every target-domain document precedes every other one, and the others enter only once prose is used up
        assert first_out.size == 0 or (inside[idx[: first_out[0]]].all() and inside[idx].sum() == inside.sum())
    assert sorted(select_oracle(pool, target, Budget(docs=5), 1, OracleConfig()).indices.tolist()) != sorted(
        select_oracle(pool, target, Budget(docs=5), 2, OracleConfig()).indices.tolist())
    with pytest.raises(SelectionError, match="no pool document is in the target domains"):
        select_oracle(pool, target, Budget(docs=1), 0, OracleConfig(target_domains=["klingon"]))
