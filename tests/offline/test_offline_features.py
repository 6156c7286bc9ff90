"""Offline building blocks: the budget rule, the proxy trainer's scores (vs autograd) and vocabulary, and the feature bank."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from selection_callbacks.core.costs import StageCosts
from selection_callbacks.data.hf_tokenizer import HFTokenizer
from selection_callbacks.data.tokenizer import ByteTokenizer
from selection_callbacks.offline.common import features as features_mod
from selection_callbacks.offline.common.corpus import Budget, SelectionError, gumbel_order, load_corpus
from selection_callbacks.offline.common.features import (
    FeatureConfig,
    distinct_ratio,
    feature_bank,
    kmeans,
    standardised_columns,
)
from selection_callbacks.offline.common.proxy_train import (
    ProxyConfig,
    make_proxy,
    pack_documents,
    score_documents,
    target_loss,
    train_proxy,
)
from selection_callbacks.offline.dsir.selector import DSIRConfig
from selection_callbacks.scoring.proxy_models import gpt_proxy_config, initialised_proxy
from tests.conftest import write_jsonl

TINY_PROXY = ProxyConfig(n_layer=1, n_head=2, n_embd=32, seq_len=64, batch_size=16, lr=1e-2)
TINY_BANK = FeatureConfig(proxy=TINY_PROXY, score_tokens=256, clusters=4, dsir=DSIRConfig(num_buckets=2048))
BYTES = ByteTokenizer()
BPE_4K = Path(__file__).resolve().parents[2] / "bench" / "results" / "long-shape" / "tokenizer.json"


def test_budget_prefix_rule() -> None:
    n_tokens = np.array([10, 20, 30, 40])
    order = np.array([3, 1, 0, 2])
    assert Budget(docs=2).take(order, n_tokens).tolist() == [3, 1]
    assert Budget(tokens=40).take(order, n_tokens).tolist() == [3]  # exactly reached
    assert Budget(tokens=41).take(order, n_tokens).tolist() == [3, 1]  # fewest documents with ≥ B tokens
    with pytest.raises(SelectionError, match="only 2 eligible"):
        Budget(docs=3).take(order[:2], n_tokens)
    with pytest.raises(SelectionError, match="exactly one budget"):
        Budget()
    with pytest.raises(SelectionError, match="≥ 1"):
        Budget(tokens=0)


def test_corpus_errors(tmp_path, tiny_corpus) -> None:
    pool = load_corpus(tiny_corpus["pool"])
    with pytest.raises(SelectionError, match="larger than the pool"):
        Budget(tokens=int(pool.n_tokens.sum()) + 1).check(pool)
    with pytest.raises(SelectionError, match="larger than the pool"):
        Budget(docs=len(pool) + 1).check(pool)
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(SelectionError, match="no documents"):
        load_corpus(tmp_path / "empty.jsonl")
    dup = write_jsonl(tmp_path / "dup.jsonl", [{"id": "a", "text": "x"}, {"id": "a", "text": "y"}])
    with pytest.raises(SelectionError, match="repeats document ids"):
        load_corpus(dup)


def test_gumbel_order_samples_proportionally() -> None:
    """First draw of Gumbel-top-k ∝ exp(log w)."""
    logw = np.log(np.array([0.6, 0.3, 0.1]))
    rng = np.random.default_rng(0)
    firsts = np.bincount([gumbel_order(logw, rng)[0] for _ in range(4000)], minlength=3) / 4000
    np.testing.assert_allclose(firsts, [0.6, 0.3, 0.1], atol=0.03)


def _docs(n: int, seed: int, length: int = 150) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    bodies = [rng.integers(97, 110, size=rng.integers(1, length)) for _ in range(n)]
    return [np.concatenate([[BYTES.bos_id], b]).astype(np.uint16) for b in bodies]


def test_proxy_scores_match_autograd() -> None:
    """Per-document loss and head-gradient cosine equal brute force through autograd on the same windows."""
    stream, target = pack_documents(_docs(12, 0), 32, BYTES), pack_documents(_docs(4, 1), 32, BYTES)
    cfg = ProxyConfig(n_layer=1, n_head=2, n_embd=16, seq_len=32, batch_size=4)
    model = train_proxy(stream, cfg, seed=0, tokens=32 * 4 * 3).model.double()
    scores = score_documents(model, stream, align_with=target)

    def head_grad_and_losses(s):
        w = torch.from_numpy(s.windows(np.arange(s.n_eval_windows)))
        pos = np.arange(s.n_eval_windows)[:, None] * s.seq_len + 1 + np.arange(s.seq_len)[None, :]
        nll = F.cross_entropy(model(w[:, :-1]).flatten(0, 1), w[:, 1:].flatten(), reduction="none")
        keep = (pos.ravel() < s.tokens.size) & (w[:, 1:].flatten().numpy() != BYTES.bos_id)
        doc = np.searchsorted(s.doc_start, pos.ravel(), side="right") - 1
        return nll, keep, doc

    nll, keep, doc = head_grad_and_losses(target)
    g_target = torch.autograd.grad(nll[torch.from_numpy(keep)].mean(), model.lm_head.weight)[0]
    nll, keep, doc = head_grad_and_losses(stream)
    for d in range(stream.n_docs):
        mine = torch.from_numpy(keep & (doc == d))
        assert scores.loss[d] == pytest.approx(float(nll[mine].mean().detach()), rel=1e-6)
        g = torch.autograd.grad(nll[mine].sum(), model.lm_head.weight, retain_graph=True)[0]
        cosine = float(F.cosine_similarity(g.flatten(), g_target.flatten(), 0))
        assert scores.grad_align[d] == pytest.approx(cosine, abs=1e-6)
    # the token-weighted mean of the document losses is the stream's loss
    counts = np.bincount(doc[keep], minlength=stream.n_docs)
    assert np.average(scores.loss, weights=counts) == pytest.approx(target_loss(model, stream), rel=1e-6)
    np.testing.assert_allclose(scores.bpb, scores.loss / np.log(2))


def test_proxy_training_is_deterministic_and_learns() -> None:
    stream = pack_documents(_docs(30, 2), 64, BYTES)
    runs = [train_proxy(stream, TINY_PROXY, seed=3, checkpoints=(0.1, 1.0), score_on=stream) for _ in range(2)]
    np.testing.assert_array_equal(runs[0].scores[1.0].loss, runs[1].scores[1.0].loss)
    assert np.nanmean(runs[0].scores[0.1].loss) > np.nanmean(runs[0].scores[1.0].loss)
    other = train_proxy(stream, TINY_PROXY, seed=4, checkpoints=(1.0,), score_on=stream)
    assert not np.array_equal(other.scores[1.0].loss, runs[0].scores[1.0].loss)


def test_the_proxy_embeds_the_vocabulary_of_the_tokenizer_its_stream_was_packed_with(tiny_corpus) -> None:
    """A 4,096-token BPE stream trains and scores a proxy of 4,096 embedding rows, built by
    scoring/proxy_models; the corpus' byte tokens give 320 rows (257 ids padded to a multiple of 64), and
    a byte proxy refuses the BPE stream with an error that says so."""
    pool = load_corpus(tiny_corpus["pool"])
    bpe = HFTokenizer(BPE_4K)
    stream = pack_documents([bpe.encode_document(text) for text in pool.texts[:40]], 64, bpe)
    assert (stream.vocab_size, stream.bos_id) == (4096, bpe.bos_id)
    assert stream.tokens.max() >= 320  # ids past the rows of a byte-sized embedding
    run = train_proxy(stream, TINY_PROXY, seed=0, checkpoints=(1.0,), score_on=stream)
    assert run.model.config.vocab_size == run.model.lm_head.weight.shape[0] == 4096
    assert np.isfinite(run.scores[1.0].loss).all() and np.isfinite(target_loss(run.model, stream))
    built = initialised_proxy(gpt_proxy_config(4096, 64, 1, 32, 2), torch_seed=5).model.state_dict()
    fresh = make_proxy(TINY_PROXY, bpe.vocab_size, seed=5).state_dict()
    assert built.keys() == fresh.keys() and all(torch.equal(built[k], fresh[k]) for k in built)
    byte_stream = pack_documents([pool.tokens(i) for i in range(40)], 64, pool.tokenizer)
    byte_model = train_proxy(byte_stream, TINY_PROXY, seed=0, tokens=64 * 16).model
    assert byte_model.config.vocab_size == 320 and byte_stream.vocab_size == ByteTokenizer.vocab_size
    with pytest.raises(ValueError, match="4096 token ids, the proxy's embedding 320 rows"):
        target_loss(byte_model, stream)


def test_small_helpers() -> None:
    words = "a b a b a b".split()
    assert distinct_ratio(words, 1) == pytest.approx(2 / 6)
    assert distinct_ratio(words, 2) == pytest.approx(2 / 5)
    assert distinct_ratio(["a"], 3) == 1.0
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.normal(0, 0.1, (20, 3)), rng.normal(5, 0.1, (20, 3))])
    labels = kmeans(x, 2, seed=0)
    assert len(set(labels[:20])) == 1 and len(set(labels[20:])) == 1 and labels[0] != labels[-1]
    z, mean, std = standardised_columns(np.array([[1.0, 5.0], [3.0, 5.0], [np.nan, 5.0]]))
    np.testing.assert_allclose(z, [[-1.0, 0.0], [1.0, 0.0], [0.0, 0.0]])


def test_feature_bank_columns_and_cache(tiny_corpus, monkeypatch) -> None:
    pool, target = load_corpus(tiny_corpus["pool"]), load_corpus(tiny_corpus["target"], "target")
    bank = feature_bank(pool, target, TINY_BANK, progress=False)
    assert set(features_mod.NUMERIC_FEATURES) | {"cluster"} == set(bank.names)
    assert all(c.shape == (len(pool),) for c in bank.columns.values())
    np.testing.assert_array_equal(bank.ids, pool.ids)
    prose, noise = bank.domains == "prose", bank.domains == "noise"
    c = bank.columns
    # the target is prose: prose is more target-like under every target-aware feature
    assert c["dsir"][prose].min() > c["dsir"][noise].max()
    assert c["grad_align"][prose].mean() > c["grad_align"][noise].mean() + 0.3
    assert c["byte_entropy"][noise].min() > c["byte_entropy"][prose].max()
    assert c["loss_final"][prose].mean() < c["loss_final"][noise].mean()
    assert np.all(c["loss_early"] > c["loss_final"]) and np.allclose(c["delta"], c["loss_early"] - c["loss_final"])
    assert c["distinct_1"][prose].max() < 0.5 and np.all(c["distinct_1"][noise] == 1.0)
    assert len(np.unique(c["cluster"][prose])) < 4  # prose and noise do not share all clusters
    assert bank.matrix(["dsir", "delta"]).shape == (len(pool), 2)
    with pytest.raises(KeyError, match="unknown feature"):
        bank.matrix(["nope"])
    # a second call reads the cache instead of recomputing
    monkeypatch.setattr(features_mod, "compute_features", lambda *a, **k: pytest.fail("recomputed a cached bank"))
    again = feature_bank(pool, target, TINY_BANK, progress=False)
    np.testing.assert_array_equal(again.columns["delta"], c["delta"])


def test_prefix_quota_is_the_largest_water_level_within_the_budget() -> None:
    rng = np.random.default_rng(0)
    for _ in range(200):
        lengths = rng.integers(2, 60, rng.integers(1, 12))
        budget = int(rng.integers(2 * lengths.size, lengths.sum() + 5))
        q = features_mod.prefix_quota(lengths, budget)
        brute = max(x for x in range(1, lengths.max() + 1) if np.minimum(lengths, x).sum() <= budget)
        assert q == brute, (lengths, budget)
    assert features_mod.prefix_quota(np.array([5, 9]), None) == 9
    with pytest.raises(ValueError, match="fewer than 2 tokens to each of the 3 documents"):
        features_mod.prefix_quota(np.array([5, 9, 4]), 5)


def test_bank_proxy_trains_on_every_documents_prefix_and_reports_its_costs(tiny_corpus, capsys) -> None:
    """The proxy takes one pass over each document's first q tokens (Σ ≤ budget); every document is scored."""
    pool, target = load_corpus(tiny_corpus["pool"]), load_corpus(tiny_corpus["target"], "target")
    lengths = pool.n_tokens
    budget = int(lengths.sum() // 3)
    bank = features_mod.compute_features(pool, target, dataclasses.replace(TINY_BANK, proxy_tokens=budget), progress=False)
    sample = bank.meta["proxy_sample"]
    q = sample["tokens_per_document"]
    assert sample["tokens"] == np.minimum(lengths, q).sum() <= budget < np.minimum(lengths, q + 1).sum()
    assert sample["whole_documents"] == int((lengths <= q).sum()) and sample["pool_tokens"] == lengths.sum()
    windows = (sample["tokens"] - 1) // TINY_PROXY.seq_len
    assert sample["steps"] == -(-windows * TINY_PROXY.seq_len // (TINY_PROXY.batch_size * TINY_PROXY.seq_len))
    assert np.isfinite(bank.columns["delta"]).all()  # every document has its Δ
    assert set(bank.meta["costs"]) == {"text", "pack", "proxy", "dsir", "embed", "kmeans"}
    assert {"train_seconds", "score_seconds"} <= set(bank.meta["costs"]["proxy"])
    assert all(c["seconds"] >= 0 and c["peak_rss_mb"] > 0 for c in bank.meta["costs"].values())
    printed = capsys.readouterr().out
    assert f"one pass over their first {q:,} tokens" in printed and "[feature bank] total" in printed
    full = features_mod.compute_features(pool, target, dataclasses.replace(TINY_BANK, proxy_tokens=None), progress=False)
    assert full.meta["proxy_sample"]["tokens"] == lengths.sum() and full.meta["proxy_sample"]["share"] == 1.0
    with pytest.raises(ValueError, match="proxy_tokens must be ≥ 1"):
        features_mod.proxy_features(pool, target, dataclasses.replace(TINY_BANK, proxy_tokens=0))


def test_stage_costs_see_a_stage_allocation() -> None:
    costs = StageCosts()
    with costs.stage("small"):
        np.ones(1000)
    with costs.stage("big"):
        block = np.ones(200_000_000 // 8)  # 200 MB, touched
        block += 1
    del block
    assert set(costs.stages) == {"small", "big"}
    assert costs.stages["big"]["peak_rss_mb"] >= costs.stages["small"]["peak_rss_mb"] + 150 or not costs.per_stage_peak
    assert costs.stages["big"]["peak_rss_mb"] > 200
    assert "[t] big" in costs.table("t") and costs.seconds == pytest.approx(sum(s["seconds"] for s in costs.stages.values()))


def test_minilm_embedder_loads_offline_and_embeds() -> None:
    """The ``embed`` extra (installed by the Makefile, so CI tests it): MiniLM from its package, no download."""
    import os

    from selection_callbacks.offline.common.embeddings import MiniLMEmbedder, make_embedder

    os.environ["HF_HUB_OFFLINE"] = "1"
    embedder = make_embedder("minilm")
    assert isinstance(embedder, MiniLMEmbedder)
    e = embedder.embed(["The cat sat on the mat.", "A cat was sitting on a mat.", "def f(x): return x ** 2"])
    assert e.shape == (3, 384) and e.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(e, axis=1), 1.0, atol=1e-5)
    assert e[0] @ e[1] > e[0] @ e[2] + 0.2  # paraphrases are closer than code
