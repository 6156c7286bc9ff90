"""Scoring windows: a seeded random window of ``score_len`` tokens from each candidate, alone or after its prefix."""

from __future__ import annotations

from collections.abc import Callable, Mapping, MutableMapping

import torch

from selection_callbacks.core.rng import micro_batch_generator

WINDOWED_KEYS = ("input_ids", "labels", "loss_mask")


def score_windows(
    batch: MutableMapping, score_len: int, generator: torch.Generator, rank: int = 0, world_size: int = 1,
    context: bool = False,
) -> dict[str, torch.Tensor]:
    """Rows of ``input_ids`` (and ``labels``/``loss_mask`` if present) cut to a random window each.

    Row r keeps tokens [o_r, o_r + L) with o_r uniform on [0, T − L] from ``generator``; with
    L ≥ T the rows are returned whole. Under DDP the offsets of the global W·N rows are drawn
    and this rank takes its slice, so each candidate's window matches a single-process run. Scoring a window of L ≪ T tokens is what keeps OPUS's
    overhead small (the paper scores 512 of 6k–24k tokens).

    With ``context`` the rows stay whole ([N, T]) and ``loss_mask`` is 1 only on the window's targets
    (times the batch's own mask): the same target tokens as the window alone (with ``labels``: positions
    [o_r, o_r + L); without, ``input_ids`` o_r + 1 … o_r + L − 1), each predicted from everything before it.
    A causal model's losses there are exactly the window's losses after its prefix; the forward (and a
    scoring backward) runs over all T tokens, T/L times the window's.

    Example::

        gen = torch.Generator().manual_seed(0)
        cut = score_windows({"input_ids": ids, "labels": labels}, 16, gen)  # [N, 16] each
        kept = score_windows({"input_ids": ids, "labels": labels}, 16, gen, context=True)  # [N, T], loss_mask [N, T]
    """
    ids = batch["input_ids"]
    n, t = ids.shape
    if score_len < 1:
        raise ValueError(f"score_len must be ≥ 1, got {score_len}")
    if score_len >= t:
        return {k: batch[k] for k in WINDOWED_KEYS if k in batch}
    offsets = torch.randint(0, t - score_len + 1, (world_size * n,), generator=generator)[rank * n : (rank + 1) * n]
    offsets = offsets.to(ids.device)
    if context:
        columns = torch.arange(t, device=ids.device)[None, :]
        first = offsets[:, None] + (0 if "labels" in batch else 1)
        window = ((columns >= first) & (columns < offsets[:, None] + score_len)).float()
        own = batch.get("loss_mask")
        rows = {k: batch[k] for k in ("input_ids", "labels") if k in batch}
        rows["loss_mask"] = window if own is None else window * own.to(window.dtype)
        return rows
    index = offsets[:, None] + torch.arange(score_len, device=ids.device)[None, :]
    return {k: torch.gather(batch[k], 1, index) for k in WINDOWED_KEYS if k in batch}


def candidate_windows(
    rows: MutableMapping, score_len: int, seed: int, epoch: int, batch_idx: int, rank: int = 0, world_size: int = 1,
    context: bool = False,
) -> dict[str, torch.Tensor]:
    """The micro-batch's candidate windows: :func:`score_windows` with offsets from the micro-batch's ``"window"``
    stream of ``seed``, so every method that cuts step (``epoch``, ``batch_idx``)'s candidates cuts each the same window,
    in any process (``rank`` of ``world_size``, as in :func:`score_windows`).

    Example::

        cut = candidate_windows(batch, 16, seed=0, epoch=0, batch_idx=3)  # [N, 16] each, the same on every call
    """
    gen = micro_batch_generator(seed, epoch, batch_idx, "window")
    return score_windows(rows, score_len, gen, rank, world_size, context)


def ignores_loss_mask(loss_fn: Callable[[Mapping], torch.Tensor], rows: Mapping) -> bool:
    """Whether ``loss_fn`` (rows → per-row losses [n]) returns the same losses when ``loss_mask`` keeps only each
    row's first half of tokens as with every token kept: a loss that ignores the mask scores windows in
    context as whole sequences. Both calls run from one seed, so dropout draws alike; the global RNG states
    are restored after each. Rows shorter than 4 tokens cannot tell (False).

    Example::

        ignores_loss_mask(lambda b: model.per_sample_loss(b), target_rows)  # False for a loss that honours it
    """
    ids = rows["input_ids"]
    if ids.shape[1] < 4:
        return False
    keys = {k: rows[k] for k in ("input_ids", "labels") if k in rows}
    whole, half = torch.ones(ids.shape, dtype=torch.float32, device=ids.device), torch.zeros(ids.shape, device=ids.device)
    half[:, : ids.shape[1] // 2] = 1.0
    losses = []
    for mask in (whole, half):  # the same seed for both calls: dropout masks alike
        with torch.random.fork_rng(devices=[ids.device] if ids.device.type == "cuda" else []), torch.no_grad():
            torch.manual_seed(0)
            losses.append(loss_fn({**keys, "loss_mask": mask}).float())
    a, b = losses
    return bool(torch.allclose(a, b, rtol=1e-6, atol=1e-7))


def ignored_mask_problem(whose: str) -> str:
    """The fit-start problem of window_context over a loss ``whose`` (e.g. "the learner's") that ignores ``loss_mask``."""
    return (f"window_context=True counts each window's loss through loss_mask, but {whose} per_sample_loss ignores "
            "loss_mask (the same losses with half the tokens masked): average the token losses over loss_mask "
            "(docs/own-model-and-data.md shows one), or drop window_context")
