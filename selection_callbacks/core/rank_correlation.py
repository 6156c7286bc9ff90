"""Spearman rank correlation, the reliability measure of score diagnostics (torch; no scipy on the hot path)."""

from __future__ import annotations

import torch


def ranks(x: torch.Tensor) -> torch.Tensor:
    """[n] average ranks 0..n−1 of a 1-D tensor (tied values share the mean of their positions)."""
    order = torch.argsort(x, stable=True)
    position = torch.empty(x.shape[0], dtype=torch.float64, device=x.device)
    position[order] = torch.arange(x.shape[0], dtype=torch.float64, device=x.device)
    _, group, counts = torch.unique(x, return_inverse=True, return_counts=True)
    sums = torch.zeros(counts.shape[0], dtype=torch.float64, device=x.device).index_add_(0, group, position)
    return (sums / counts)[group]


def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    """Pearson correlation of the average ranks of ``a`` and ``b`` [n] over the entries finite in both.

    NaN when fewer than 3 such entries remain or either side is constant there.
    """
    ok = torch.isfinite(a) & torch.isfinite(b)
    if int(ok.sum()) < 3:
        return float("nan")
    ra, rb = ranks(a[ok].double()), ranks(b[ok].double())
    ra, rb = ra - ra.mean(), rb - rb.mean()
    denom = (ra.square().sum() * rb.square().sum()).sqrt()
    return float((ra * rb).sum() / denom) if denom > 0 else float("nan")
