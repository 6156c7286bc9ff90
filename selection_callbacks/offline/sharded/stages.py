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

from selection_callbacks.offline.dsir import hashed_ngrams
from selection_callbacks.offline.embeddings import HashedNgramEmbedder
from selection_callbacks.offline.features import NGRAM_ORDERS, distinct_ratio

__all__ = ["byte_histograms", "count_columns", "embed_columns", "score_columns"]


def byte_histograms(texts: list[str]) -> np.ndarray:
    """float64 [n, 256]: each document's UTF-8 byte counts."""
    out = np.zeros((len(texts), 256))
    for i, text in enumerate(texts):
        out[i] = np.bincount(np.frombuffer(text.encode("utf-8", errors="replace"), np.uint8), minlength=256)
    return out


def count_columns(texts: list[str], seq_len: int, num_buckets: int) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(per-document columns [n] each, shard totals ``bytes`` int64 [256] and ``buckets`` int64 [B])."""
    counts = byte_histograms(texts)
    n_bytes = counts.sum(1)
    safe = np.maximum(n_bytes, 1)[:, None]
    p = counts / safe
    with np.errstate(divide="ignore", invalid="ignore"):
        entropy = -np.where(p > 0, p * np.log2(p), 0.0).sum(1)
    n_tokens = np.asarray([len(t.encode("utf-8", errors="replace")) + 1 for t in texts], dtype=np.int64)
    distinct = np.asarray([[distinct_ratio(t.split(), n) for n in NGRAM_ORDERS] for t in texts]).reshape(-1, 5)
    buckets = np.zeros(num_buckets, dtype=np.int64)
    n_grams = np.zeros(len(texts), dtype=np.int64)
    for i, text in enumerate(texts):
        b = hashed_ngrams(text, num_buckets)
        buckets += np.bincount(b, minlength=num_buckets)
        n_grams[i] = b.size
    cols = {"n_bytes": n_bytes, "n_tokens": n_tokens, "n_chars": np.asarray([len(t) for t in texts], dtype=np.int64)}
    cols.update({f"distinct_{n}": distinct[:, j] for j, n in enumerate(NGRAM_ORDERS)})
    cols["non_ascii"] = counts[:, 128:].sum(1) / safe[:, 0]
    cols["byte_entropy"] = entropy
    cols["bos_per_seq"] = seq_len / n_tokens
    cols["dsir_ngrams"] = n_grams
    return cols, {"bytes": counts.sum(0).astype(np.int64), "buckets": buckets}


def score_columns(texts: list[str], byte_logp: np.ndarray, dsir_ratio: np.ndarray) -> dict[str, np.ndarray]:
    """``log_freq`` [n] = mean over bytes of log p_pool(byte); ``dsir_logw`` [n] = Σ_b c_x[b]·ratio[b]."""
    counts = byte_histograms(texts)
    safe = np.maximum(counts.sum(1), 1)
    B = dsir_ratio.size
    logw = np.asarray([dsir_ratio[hashed_ngrams(t, B)].sum() for t in texts], dtype=np.float64)
    return {"log_freq": (counts @ byte_logp) / safe, "dsir_logw": logw}


def embed_columns(texts: list[str]) -> np.ndarray:
    """float32 [n, d]: :class:`HashedNgramEmbedder` vectors, one document at a time."""
    embedder = HashedNgramEmbedder()
    return np.stack([embedder.vector(t) for t in texts]) if texts else np.zeros((0, embedder.dim), np.float32)
