"""Per-document quality scores a selector weighs: from the feature bank, or from text and embeddings alone.

:func:`bank_quality` reads the feature bank's columns (target closeness, repetition, stray bytes);
:func:`heuristic_quality` needs no proxy training (the cosine to the target's mean embedding and two
text heuristics). Both are means of clipped z-scores, so every signal weighs the same.

Example::

    quality = bank_quality(feature_bank(corpus, target, FeatureConfig()))  # [D], higher is better
"""

from __future__ import annotations

import re

import numpy as np

from selection_callbacks.offline.common.features import FeatureBank

__all__ = ["BANK_QUALITY", "bank_quality", "heuristic_quality", "text_heuristics", "zscores"]


def zscores(x: np.ndarray) -> np.ndarray:
    """(x − mean)/std of the whole array, zeros when x is constant."""
    x = np.asarray(x, dtype=np.float64)
    sd = x.std()
    return (x - x.mean()) / sd if sd > 0 else np.zeros_like(x)


_CLEAN = re.compile(r"[A-Za-z0-9\s.,;:!?'\"()\[\]{}<>=+\-*/_#%&@|\\`~^$]")
BANK_QUALITY = (("dsir", 1.0), ("grad_align", 1.0), ("distinct_3", 1.0), ("non_ascii", -1.0))
"""Feature-bank columns of :func:`bank_quality` with their signs."""


def _mean_z(columns: list[np.ndarray]) -> np.ndarray:
    """Mean of the columns' z-scores, each clipped to ±3 (NaN counts as the column mean)."""
    return np.mean([np.clip(zscores(np.nan_to_num(c, nan=float(np.nanmean(c)))), -3, 3) for c in columns], axis=0)


def bank_quality(bank: FeatureBank) -> np.ndarray:
    """Quality from the feature bank [D]: the mean clipped z-score of the signed :data:`BANK_QUALITY` columns.

    DSIR importance and gradient alignment to the target (higher is closer), the distinct word-3-gram
    ratio (low is repetitive) and minus the non-ASCII byte share (corrupted or non-English text).
    """
    return _mean_z([sign * bank.columns[name].astype(np.float64) for name, sign in BANK_QUALITY])


def text_heuristics(texts: list[str], max_chars: int = 4000) -> np.ndarray:
    """Per document [n, 2]: distinct character-8-gram ratio and the share of plain ASCII text characters.

    Low distinct ratio flags repetition; a low clean share flags corrupted or non-text bytes.
    Both read the first ``max_chars`` characters.
    """
    out = np.zeros((len(texts), 2))
    for i, t in enumerate(texts):
        t = t[:max_chars]
        grams = [t[k : k + 8] for k in range(max(len(t) - 7, 0))]
        out[i, 0] = len(set(grams)) / len(grams) if grams else 0.0
        out[i, 1] = len(_CLEAN.findall(t)) / len(t) if t else 0.0
    return out


def heuristic_quality(texts: list[str], emb: np.ndarray, target_emb: np.ndarray) -> np.ndarray:
    """Quality without the feature bank (no proxy training) [n]: the mean clipped z-score of the
    cosine to the target's mean embedding and the two :func:`text_heuristics`."""
    centroid = target_emb.mean(0)
    centroid /= max(float(np.linalg.norm(centroid)), 1e-12)
    return _mean_z([emb @ centroid, *text_heuristics(texts).T])
