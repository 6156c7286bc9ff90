"""Warmup delta (the report's second method): documents a proxy learns most during one pass over the pool.

A proxy trained one pass over the pool is scored at an early checkpoint (10% of its steps) and at
the end; Δ(x) = ℓ_early(x) − ℓ_final(x) (feature-bank columns ``loss_early``/``loss_final``).
Plain top-K of Δ picks foreign-language text (top tail) and corrupted text (as the report finds), so
documents with Δ above the (100 − ``trim_high``)-th percentile or below the ``trim_low``-th
percentile (over documents) are dropped first and the rest ranked by Δ, largest first.
Deterministic: the selection seed plays no part (the proxy uses ``bank.seed``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from selection_callbacks.offline.corpus import Budget, Corpus, Selection
from selection_callbacks.offline.features import FeatureConfig, feature_bank

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
