"""Scoring windows: a seeded random window of ``score_len`` tokens from each candidate."""

from __future__ import annotations

from collections.abc import MutableMapping

import torch

WINDOWED_KEYS = ("input_ids", "labels", "loss_mask")


def score_windows(
    batch: MutableMapping, score_len: int, generator: torch.Generator, rank: int = 0, world_size: int = 1
) -> dict[str, torch.Tensor]:
    """Rows of ``input_ids`` (and ``labels``/``loss_mask`` if present) cut to a random window each.

    Row r keeps tokens [o_r, o_r + L) with o_r uniform on [0, T − L] from ``generator``; with
    L ≥ T the rows are returned whole. Under DDP the offsets of the global W·N rows are drawn
    and this rank takes its slice, so each candidate's window matches a single-process run. Scoring a window of L ≪ T tokens is what keeps OPUS's
    overhead small (the paper scores 512 of 6k–24k tokens).
    """
    ids = batch["input_ids"]
    n, t = ids.shape
    if score_len < 1:
        raise ValueError(f"score_len must be ≥ 1, got {score_len}")
    if score_len >= t:
        return {k: batch[k] for k in WINDOWED_KEYS if k in batch}
    offsets = torch.randint(0, t - score_len + 1, (world_size * n,), generator=generator)[rank * n : (rank + 1) * n]
    offsets = offsets.to(ids.device)
    index = offsets[:, None] + torch.arange(score_len, device=ids.device)[None, :]
    return {k: torch.gather(batch[k], 1, index) for k in WINDOWED_KEYS if k in batch}
