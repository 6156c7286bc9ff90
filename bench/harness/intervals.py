"""Student-t confidence intervals: the one half-width the bench's reports and the README's tables use."""

from __future__ import annotations

import numpy as np


def t_half_width(se: float | np.ndarray, df: int, level: float = 0.95) -> float | np.ndarray:
    """Half-width t_{(1+level)/2, df} · se of the two-sided t-interval around an estimate (nan where df < 1).

    A mean of n values with sample standard deviation s has se = s/√n and df = n − 1; a least-squares slope over
    n points has its standard error and df = n − 2.

    Args:
        se: the estimate's standard error: a number, or an array of them (one interval each).
        df: degrees of freedom.
        level: the interval's coverage.

    Returns:
        A float for a number ``se``, else an array shaped like ``se``.

    Example::

        t_half_width(0.02 / 3**0.5, df=2)  # 0.0497: three paired seeds whose differences have sd 0.02
    """
    if df < 1:
        return float("nan") if np.ndim(se) == 0 else np.full(np.shape(se), np.nan)
    from scipy import stats

    half = stats.t.ppf((1 + level) / 2, df) * np.asarray(se, dtype=float)
    return float(half) if half.ndim == 0 else half
