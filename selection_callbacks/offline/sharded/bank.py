"""The sharded path's stages in order, and the global steps between them, run by the driver.

- ``count`` (map): cheap columns, per-shard byte and bucket totals.
- global: the pool's byte log-probabilities and DSIR's bucket log-ratio (the target's counts are
  computed here: the target split is small).
- ``score`` (map): ``log_freq`` and DSIR's log w per document.
- ``embed`` (map, bank only): hashed n-gram embeddings; global: k-means on them.
- global, bank only: the proxy GPT (:func:`features.proxy_features`) trains on and scores each
  document's first max(q, score_tokens) tokens, read from the shards one at a time.

The driver holds per-document columns and those prefixes, never the pool's whole text.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from selection_callbacks.core.costs import StageCosts
from selection_callbacks.data.tokenizer import ByteTokenizer
from selection_callbacks.offline.common.corpus import Corpus, SelectionError
from selection_callbacks.offline.common.features import (
    NUMERIC_FEATURES,
    FeatureBank,
    FeatureConfig,
    byte_log_probs,
    kmeans,
    prefix_quota,
    proxy_features,
)
from selection_callbacks.offline.dsir.selector import DSIRConfig, bucket_log_ratio, target_bucket_counts
from selection_callbacks.offline.sharded.runner import ShardedEngine
from selection_callbacks.offline.sharded.shards import PoolShards, file_fingerprint
from selection_callbacks.offline.sharded.tables import (
    TableIndex,
    count_task,
    embed_task,
    read_columns,
    read_embeddings,
    read_index,
    read_totals,
    score_task,
)

__all__ = ["ScoredPool", "TokenPrefixes", "score_pool", "sharded_bank", "sharded_embeddings"]

COUNT_COLUMNS = ("n_bytes", "n_tokens", "distinct_1", "distinct_2", "distinct_3", "distinct_4", "distinct_5",
                 "non_ascii", "byte_entropy", "bos_per_seq", "dsir_ngrams")


@dataclass
class ScoredPool:
    """The pool after ``count`` and ``score``: its index and per-document columns (float64 [D] each)."""

    index: TableIndex
    columns: dict[str, np.ndarray]


def score_pool(engine: ShardedEngine, shards: PoolShards, target: Corpus, dsir: DSIRConfig, seq_len: int,
               costs: StageCosts) -> ScoredPool:
    """Stages ``count`` and ``score`` with the global statistics between them."""
    count_settings = {"seq_len": seq_len, "num_buckets": dsir.num_buckets}
    count_paths = engine.run_stage("count", count_task, shards, count_settings, count_settings)
    with costs.stage("global statistics"):
        totals = read_totals(count_paths)
        byte_logp = byte_log_probs(totals["bytes"])
        ratio = bucket_log_ratio(target_bucket_counts(target.texts, dsir.num_buckets),
                                 totals["buckets"].astype(np.float64), dsir)
    score_settings = {**count_settings, "dsir": asdict(dsir), "target": file_fingerprint(target.path)}
    score_paths = engine.run_stage("score", score_task, shards, {"byte_logp": byte_logp, "dsir_ratio": ratio},
                                   score_settings)
    with costs.stage("read tables"):
        index = read_index(count_paths, [shards.path(k) for k in range(len(shards))])
        columns = read_columns(count_paths, list(COUNT_COLUMNS)) | read_columns(score_paths, ["log_freq", "dsir_logw"])
    return ScoredPool(index, columns)


def sharded_embeddings(engine: ShardedEngine, shards: PoolShards, embedder: str) -> np.ndarray:
    """float32 [D, d] hashed n-gram embeddings from stage ``embed``; other embedders are an error."""
    if embedder != "hashed":
        raise SelectionError(f"the sharded path embeds with hashed n-grams only, got embedder {embedder!r}; "
                             "set the embedder to hashed or use --engine local")
    return read_embeddings(engine.run_stage("embed", embed_task, shards, {}, {"embedder": "hashed"}))


class TokenPrefixes:
    """The first ``keep`` ByteTokenizer tokens of every pool document, read shard by shard (what the proxy reads).

    ``len``, ``tokens(i)`` and ``tokenizer`` as :class:`Corpus` has them; ``n_tokens`` are the documents' full
    lengths.
    """

    def __init__(self, shards: PoolShards, n_tokens: np.ndarray, keep: int) -> None:
        self.tokenizer = ByteTokenizer()
        self.n_tokens = n_tokens
        self._docs = [self.tokenizer.encode_document(t)[:keep] for k in range(len(shards)) for t in shards.texts(k)]

    def __len__(self) -> int:
        return len(self._docs)

    def tokens(self, i: int) -> np.ndarray:
        return self._docs[i]


def sharded_bank(engine: ShardedEngine, shards: PoolShards, target: Corpus, cfg: FeatureConfig, costs: StageCosts,
                 progress: bool = True) -> tuple[TableIndex, FeatureBank, np.ndarray]:
    """The feature bank of :func:`features.compute_features`, column for column, from the sharded stages;
    also its embeddings [D, d]."""
    scored = score_pool(engine, shards, target, cfg.dsir, cfg.proxy.seq_len, costs)
    c = scored.columns
    cols = {n: c[n].astype(np.float64) for n in COUNT_COLUMNS if n != "dsir_ngrams"}
    cols["log_freq"] = c["log_freq"]
    n_tokens = scored.index.n_tokens
    keep = prefix_quota(n_tokens, cfg.proxy_tokens)
    keep = int(n_tokens.max()) if cfg.score_tokens is None else max(keep, cfg.score_tokens)
    with costs.stage("read token prefixes"):
        prefixes = TokenPrefixes(shards, n_tokens, keep)
    proxy_cols, sample = proxy_features(prefixes, target, cfg, costs, progress)
    del prefixes
    cols.update(proxy_cols)
    cols["dsir"] = c["dsir_logw"] / np.maximum(c["dsir_ngrams"], 1)
    emb = sharded_embeddings(engine, shards, cfg.embedder)
    with costs.stage("kmeans"):
        cols["cluster"] = kmeans(emb, cfg.clusters, cfg.seed)
    missing = set(NUMERIC_FEATURES) - set(cols)
    if missing:
        raise RuntimeError(f"the sharded bank lacks {sorted(missing)}")
    meta = {"config": asdict(cfg), "embedder": "hashed-ngram", "proxy_sample": sample, "costs": costs.as_dict()}
    bank = FeatureBank(ids=scored.index.ids, domains=scored.index.domains, columns=cols, meta=meta)
    return scored.index, bank, emb
