"""Warmup delta (the report's second method): documents a pool proxy learns most about while it trains.

The feature bank's proxy trains one pass over a sample of the pool (``bank.proxy_tokens``: every
document's first q tokens, q set by the budget; the whole pool when the budget covers it) and
scores every document's first ``score_tokens`` tokens at an early checkpoint (10% of its steps) and
at the end; Δ(x) = ℓ_early(x) − ℓ_final(x) (feature-bank columns ``loss_early``/``loss_final``).

What Δ means with a sampled proxy (pools past the budget, 8M tokens by default; the default corpus
is trained whole): between the two checkpoints the proxy reads the first q tokens of every
document once, at a random time, and learns the pool's distribution from them. Where q covers the
scored tokens (short documents) Δ(x) is, as with a one-pass proxy, what one read of x and of the
rest of the pool taught the proxy about x. Past q the scored tokens are held out: Δ there is how
much more predictable x becomes from learning the pool, without having read that part of x.
Every document is treated alike, so Δ ranks documents by what is learnable in them, not by
whether they were drawn. A smaller sample also means a shorter run, whose 10% checkpoint comes
after fewer tokens, so a smaller ``bank.proxy_tokens`` changes the ranking, not only its cost.

Plain top-K of Δ picks foreign-language text (top tail) and corrupted text (as the report finds), so
documents with Δ above the (100 − ``trim_high``)-th percentile or below the ``trim_low``-th
percentile (over documents) are dropped first and the rest ranked by Δ, largest first.
Deterministic: the selection seed plays no part (the proxy uses ``bank.seed``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from selection_callbacks.offline.common.corpus import Budget, Corpus, Selection
from selection_callbacks.offline.common.features import FeatureConfig, feature_bank

__all__ = ["WarmupDeltaConfig", "delta_order", "select_warmup_delta"]


@dataclass
class WarmupDeltaConfig:
    """Warmup-delta settings.

    Attributes:
        trim_low: drop documents whose Δ is below this percentile (0 keeps them).
        trim_high: drop documents whose Δ is above the (100 − trim_high)-th percentile (0 keeps them).
        bank: the feature bank whose proxy gives ℓ_early and ℓ_final.
    """

    trim_low: float = 2.0
    trim_high: float = 2.0
    bank: FeatureConfig = field(default_factory=FeatureConfig)


def delta_order(delta: np.ndarray, trim_low: float, trim_high: float) -> np.ndarray:
    """Indices of the documents kept by the trimming, by descending Δ (NaN Δ never kept; ties by index)."""
    if not (0.0 <= trim_low < 100.0 and 0.0 <= trim_high < 100.0 and trim_low + trim_high < 100.0):
        raise ValueError(f"trim percentiles must be ≥ 0 and leave something: got low={trim_low}, high={trim_high}")
    delta = np.asarray(delta, dtype=np.float64)
    finite = np.isfinite(delta)
    if not finite.any():
        raise ValueError("no document has a finite Δ (documents without byte tokens cannot be scored)")
    lo, hi = np.percentile(delta[finite], [trim_low, 100.0 - trim_high])
    keep = finite
    if trim_low > 0:
        keep = keep & (delta >= lo)
    if trim_high > 0:
        keep = keep & (delta <= hi)
    idx = np.flatnonzero(keep)
    return idx[np.argsort(-delta[idx], kind="stable")]


def select_warmup_delta(
    pool: Corpus, target: Corpus, budget: Budget, seed: int, cfg: WarmupDeltaConfig, progress: bool = True
) -> Selection:
    """Top of Δ among the untrimmed documents, cut by the budget."""
    delta = feature_bank(pool, target, cfg.bank, progress=progress).columns["delta"]
    order = delta_order(delta, cfg.trim_low, cfg.trim_high)
    chosen = budget.take(order, pool.n_tokens)
    return Selection(
        chosen,
        {
            "trimmed_documents": int(len(pool) - order.size),
            "delta_quantiles": dict(zip(("min", "median", "max"), np.nanquantile(delta, [0, 0.5, 1]).tolist())),
            "chosen_delta_range": [float(delta[chosen].min()), float(delta[chosen].max())],
        },
    )
