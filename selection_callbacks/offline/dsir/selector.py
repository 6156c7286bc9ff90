"""DSIR: importance resampling toward the target with hashed n-gram features (Xie et al. 2023).

Each document x becomes counts c_x over B hash buckets of its lower-cased word unigrams and
bigrams. Two bag-of-buckets models are fitted with additive smoothing α,
p(b) = (Σ_x c_x[b] + α) / (Σ_b' Σ_x c_x[b'] + α·B), one on the target and one on the pool
("raw"). The log importance weight is

    log w(x) = Σ_b c_x[b] · (log p_target(b) − log p_raw(b)),

and the subset is a sample without replacement ∝ w: Gumbel-top-k on log w, cut by the budget.
"""

from __future__ import annotations

import re
import zlib
from dataclasses import dataclass

import numpy as np
from tqdm.auto import tqdm

from selection_callbacks.core.sampling import gumbel_order
from selection_callbacks.offline.common.corpus import Budget, Corpus, Selection

__all__ = [
    "DSIRConfig", "bucket_log_ratio", "hashed_ngrams", "log_importance", "resample", "select_dsir", "target_bucket_counts",
]

_TOKEN = re.compile(r"\w+|[^\w\s]", re.UNICODE)


@dataclass
class DSIRConfig:
    """DSIR settings.

    Attributes:
        num_buckets: hash buckets B shared by unigrams and bigrams (DSIR's default 10,000).
        smoothing: additive pseudo-count α per bucket in both n-gram models.
    """

    num_buckets: int = 10_000
    smoothing: float = 1.0


def hashed_ngrams(text: str, num_buckets: int) -> np.ndarray:
    """Bucket ids [m] of the word unigrams and bigrams of ``text`` (crc32 words, bigrams mixed from them)."""
    words = _TOKEN.findall(text.lower())
    if not words:
        return np.empty(0, dtype=np.int64)
    h = np.fromiter((zlib.crc32(w.encode()) for w in words), dtype=np.uint64, count=len(words))
    with np.errstate(over="ignore"):
        bigrams = h[:-1] * np.uint64(0x9E3779B97F4A7C15) + h[1:] * np.uint64(0xC2B2AE3D27D4EB4F)  # wraps mod 2⁶⁴
    return (np.concatenate([h, bigrams >> np.uint64(16)]) % np.uint64(num_buckets)).astype(np.int64)


def _bucket_log_probs(counts: np.ndarray, alpha: float) -> np.ndarray:
    return np.log(counts + alpha) - np.log(counts.sum() + alpha * counts.size)


def target_bucket_counts(texts: list[str], num_buckets: int) -> np.ndarray:
    """float64 [B]: the target's n-gram counts per bucket."""
    counts = np.zeros(num_buckets)
    for t in texts:
        counts += np.bincount(hashed_ngrams(t, num_buckets), minlength=num_buckets)
    return counts


def bucket_log_ratio(target_counts: np.ndarray, pool_counts: np.ndarray, cfg: DSIRConfig) -> np.ndarray:
    """float64 [B]: log p_target(b) − log p_raw(b), both smoothed by α; a pool document's log w sums it over its n-grams."""
    if cfg.num_buckets < 1 or cfg.smoothing <= 0:
        raise ValueError(f"DSIR needs num_buckets ≥ 1 and smoothing > 0, got {cfg.num_buckets}, {cfg.smoothing}")
    return _bucket_log_probs(target_counts, cfg.smoothing) - _bucket_log_probs(pool_counts, cfg.smoothing)


def log_importance(
    pool: Corpus, target: Corpus, cfg: DSIRConfig, progress: bool = True
) -> tuple[np.ndarray, np.ndarray]:
    """(log w [D], n-gram count [D]) of every pool document; log w / count is the per-n-gram mean."""
    if cfg.num_buckets < 1 or cfg.smoothing <= 0:
        raise ValueError(f"DSIR needs num_buckets ≥ 1 and smoothing > 0, got {cfg.num_buckets}, {cfg.smoothing}")
    B = cfg.num_buckets
    pool_buckets = [
        hashed_ngrams(t, B) for t in tqdm(pool.texts, desc="DSIR: hashing pool", unit="doc", disable=not progress)
    ]
    pool_counts = np.bincount(np.concatenate(pool_buckets), minlength=B).astype(np.float64)
    diff = bucket_log_ratio(target_bucket_counts(target.texts, B), pool_counts, cfg)
    logw = np.asarray([diff[b].sum() for b in pool_buckets])
    return logw, np.asarray([b.size for b in pool_buckets], dtype=np.int64)


def select_dsir(
    pool: Corpus, target: Corpus, budget: Budget, seed: int, cfg: DSIRConfig, progress: bool = True
) -> Selection:
    """Gumbel-top-k on log w(x), cut by the budget."""
    logw, _ = log_importance(pool, target, cfg, progress)
    return resample(logw, pool.n_tokens, budget, seed)


def resample(logw: np.ndarray, n_tokens: np.ndarray, budget: Budget, seed: int) -> Selection:
    """Gumbel-top-k on log w [D] (seeded by ``seed``), cut by the budget."""
    order = gumbel_order(logw, np.random.default_rng([seed, 0xD51]))
    chosen = budget.take(order, n_tokens)
    q = np.quantile(logw, [0.0, 0.5, 1.0])
    return Selection(
        chosen,
        {
            "log_importance_quantiles": {"min": float(q[0]), "median": float(q[1]), "max": float(q[2])},
            "chosen_min_log_importance": float(logw[chosen].min()),
        },
    )
