"""What one shard's documents compute: fixed per-document functions, so results never depend on sharding.

Two passes over the text, with a global reduction between them:

1. :func:`count_columns`: per document the bank's cheap columns (n_bytes, n_tokens, n_chars,
   distinct_1..5, non_ascii, byte_entropy, bos_per_seq) and the DSIR n-gram count; per shard the
   byte histogram [256] and the DSIR bucket counts [B] (int64, so their sum over shards is exact).
2. :func:`score_columns`: with the pool's byte log-probabilities [256] and DSIR's bucket
   log-ratio [B] = log p_target − log p_raw, per document ``log_freq`` and ``dsir_logw``
   (Σ_b c_x[b]·ratio[b]).

:func:`embed_columns` is the hashed n-gram embedding [n, d] of each document. Every formula is the
single-process one (:func:`features.text_features`, :func:`dsir.log_importance`) applied to the
shard's rows.
"""

from __future__ import annotations

import numpy as np

from selection_callbacks.offline.common.embeddings import HashedNgramEmbedder
from selection_callbacks.offline.common.features import (
    NGRAM_ORDERS,
    byte_columns,
    byte_histogram,
    distinct_ratios,
    log_frequency,
)
from selection_callbacks.offline.dsir.selector import hashed_ngrams

__all__ = ["byte_histograms", "count_columns", "embed_columns", "score_columns"]


def byte_histograms(texts: list[str]) -> np.ndarray:
    """float64 [n, 256]: each document's UTF-8 byte counts."""
    out = np.zeros((len(texts), 256))
    for i, text in enumerate(texts):
        out[i] = byte_histogram(text)
    return out


def count_columns(texts: list[str], seq_len: int, num_buckets: int) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(per-document columns [n] each, shard totals ``bytes`` int64 [256] and ``buckets`` int64 [B])."""
    counts = byte_histograms(texts)
    n_tokens = np.asarray([len(t.encode("utf-8", errors="replace")) + 1 for t in texts], dtype=np.int64)
    distinct = np.asarray([distinct_ratios(t) for t in texts]).reshape(-1, len(NGRAM_ORDERS))
    buckets = np.zeros(num_buckets, dtype=np.int64)
    n_grams = np.zeros(len(texts), dtype=np.int64)
    for i, text in enumerate(texts):
        b = hashed_ngrams(text, num_buckets)
        buckets += np.bincount(b, minlength=num_buckets)
        n_grams[i] = b.size
    by_bytes = byte_columns(counts)
    cols = {"n_bytes": by_bytes["n_bytes"], "n_tokens": n_tokens,
            "n_chars": np.asarray([len(t) for t in texts], dtype=np.int64)}
    cols.update({f"distinct_{n}": distinct[:, j] for j, n in enumerate(NGRAM_ORDERS)})
    cols["non_ascii"] = by_bytes["non_ascii"]
    cols["byte_entropy"] = by_bytes["byte_entropy"]
    cols["bos_per_seq"] = seq_len / n_tokens
    cols["dsir_ngrams"] = n_grams
    return cols, {"bytes": counts.sum(0).astype(np.int64), "buckets": buckets}


def score_columns(texts: list[str], byte_logp: np.ndarray, dsir_ratio: np.ndarray) -> dict[str, np.ndarray]:
    """``log_freq`` [n] = mean over bytes of log p_pool(byte); ``dsir_logw`` [n] = Σ_b c_x[b]·ratio[b]."""
    B = dsir_ratio.size
    logw = np.asarray([dsir_ratio[hashed_ngrams(t, B)].sum() for t in texts], dtype=np.float64)
    return {"log_freq": log_frequency(byte_histograms(texts), byte_logp), "dsir_logw": logw}


def embed_columns(texts: list[str]) -> np.ndarray:
    """float32 [n, d]: :class:`HashedNgramEmbedder` vectors, one document at a time."""
    embedder = HashedNgramEmbedder()
    return np.stack([embedder.vector(t) for t in texts]) if texts else np.zeros((0, embedder.dim), np.float32)
