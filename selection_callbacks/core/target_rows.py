"""What target rows must be, checked before the first step.

Methods that score against the target split (the target rows of OPUS and GREATS, the reference
pretraining of RHO-LOSS and ClassAct) draw ``datamodule.target_batch(n, rng)``. Its rows must be a
dict whose token entries (``input_ids``, optional ``labels`` and ``loss_mask``) are 2-D [n, T]
tensors with at least one row, ids inside the learner's vocabulary and finite masks, and they must
carry the same token entries, of the same kind of dtype, as the training superbatches. (A
superbatch's own non-finite rows are the base class's ``nonfinite`` policy's to handle, row by row.)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["TOKEN_KEYS", "target_rows_problems", "token_problems", "unlike_target"]

TOKEN_KEYS = ("input_ids", "labels", "loss_mask")


def target_rows_problems(rows: Any, vocab: int | None) -> list[str]:
    """What is wrong with one draw of ``target_batch`` (each problem with its fix; [] when nothing is)."""
    if not isinstance(rows, Mapping):
        return [f"returned a {type(rows).__name__}: return a dict of [n, T] tensors ('input_ids', optional 'labels', "
                "'loss_mask')"]
    ids = rows.get("input_ids")
    if not isinstance(ids, torch.Tensor):
        return [f"returned no 'input_ids' tensor (keys {sorted(rows)}): return the rows' token ids as 'input_ids' [n, T]"]
    problems = []
    for key in TOKEN_KEYS:
        value = rows.get(key)
        if isinstance(value, torch.Tensor) and value.ndim != 2:
            problems.append(f"returned '{key}' of shape {tuple(value.shape)}: each token entry is a 2-D tensor [n, T], "
                            "one row per target sequence (stack the rows, or add a first dimension to a single row)")
    if problems:
        return problems
    if ids.shape[0] == 0:
        return [f"returned no rows ('input_ids' of shape {tuple(ids.shape)}): the target split is empty; give it at least "
                "one sequence of T tokens (PoolDataModule: documents in --data.target)"]
    problems = token_problems(rows, vocab)
    mask = rows.get("loss_mask")
    if isinstance(mask, torch.Tensor) and mask.is_floating_point() and not torch.isfinite(mask).all():
        bad = (~torch.isfinite(mask)).reshape(mask.shape[0], -1).any(1).nonzero().flatten().tolist()
        problems.append(f"returned non-finite 'loss_mask' values in rows {bad[:8]}: a mask holds a finite weight per "
                        "token (0 or 1), and one non-finite target row makes every score non-finite")
    return problems


def token_problems(rows: Mapping[str, Any], vocab: int | None) -> list[str]:
    """Token ids that are not integers or fall outside [0, vocab) (``labels`` may hold negative ignore indices)."""
    problems = []
    for key in ("input_ids", "labels"):
        value = rows.get(key)
        if not isinstance(value, torch.Tensor) or value.numel() == 0:
            continue
        if value.is_floating_point() or value.dtype == torch.bool:
            problems.append(f"holds '{key}' as {value.dtype}: token ids are integer tensors (torch.long)")
            continue
        low, high = int(value.min()), int(value.max())
        if vocab is not None and high >= vocab:
            problems.append(f"holds '{key}' up to id {high}, beyond the learner's vocabulary of {vocab} ids: tokenize it "
                            f"with the learner's tokenizer, or build the learner with a vocabulary of at least {high + 1}")
        if key == "input_ids" and low < 0:
            problems.append(f"holds a negative '{key}' id ({low}): token ids lie in [0, vocabulary)")
    return problems


def unlike_target(superbatch: Mapping[str, Any], target: Mapping[str, Any]) -> list[str]:
    """How a superbatch's token entries differ from the target rows': ``labels`` on one side only, or an entry
    whose dtype is of another kind (integer, floating, bool) on each side."""
    problems = []
    if ("labels" in superbatch) != ("labels" in target):
        has = "the superbatch carries 'labels' and the target rows do" if "labels" in superbatch else (
            "the target rows carry 'labels' and the superbatch does")
        problems.append(f"{has} not: candidates are scored against target rows, so both carry pre-shifted labels or "
                        "neither does (add them to target_batch, or drop them from the training batches)")
    for key in TOKEN_KEYS:
        mine, theirs = superbatch.get(key), target.get(key)
        if isinstance(mine, torch.Tensor) and isinstance(theirs, torch.Tensor) and _kind(mine) != _kind(theirs):
            problems.append(f"the superbatch's '{key}' is {mine.dtype} and the target rows' is {theirs.dtype}: give "
                            "both the same dtype")
    return problems


def _kind(value: torch.Tensor) -> str:
    if value.dtype == torch.bool:
        return "bool"
    return "floating" if value.is_floating_point() or value.is_complex() else "integer"
