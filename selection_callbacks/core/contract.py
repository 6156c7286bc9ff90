"""The superbatch contract: validate a dict batch and subset its per-sample entries in place."""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

import torch


class SuperbatchError(ValueError):
    """A batch that does not follow the superbatch contract."""


def superbatch_size(batch: Any) -> int:
    """N of a superbatch; raises :class:`SuperbatchError` naming what is wrong."""
    if not isinstance(batch, MutableMapping):
        raise SuperbatchError(
            f"selection needs a dict batch with 'input_ids' [N, T], got {type(batch).__name__}; "
            "make the DataLoader yield dicts (see PoolDataModule) or wrap your collate_fn"
        )
    ids = batch.get("input_ids")
    if ids is None:
        raise SuperbatchError(f"superbatch has no 'input_ids' key (keys: {sorted(batch)}); it is required")
    if not isinstance(ids, torch.Tensor) or ids.ndim != 2:
        raise SuperbatchError(f"'input_ids' must be a 2-D tensor [N, T], got {getattr(ids, 'shape', type(ids))}")
    n = ids.shape[0]
    for key in ("labels", "loss_mask", "sample_id", "domain"):
        value = batch.get(key)
        if isinstance(value, torch.Tensor) and (value.ndim == 0 or value.shape[0] != n):
            raise SuperbatchError(f"'{key}' has shape {tuple(value.shape)}, expected first dimension N={n}")
    return n


def per_sample_keys(batch: MutableMapping, n: int) -> list[str]:
    """Keys whose value is per sample: a tensor with first dimension N, or a list/tuple of length N."""
    keys = []
    for key, value in batch.items():
        if isinstance(value, torch.Tensor) and value.ndim >= 1 and value.shape[0] == n:
            keys.append(key)
        elif isinstance(value, (list, tuple)) and len(value) == n:
            keys.append(key)
    return keys


def subset_in_place(batch: MutableMapping, index: torch.Tensor) -> None:
    """Keep rows ``index`` of every per-sample entry, mutating ``batch`` itself.

    Lightning passes the same dict object on to ``training_step``; rebinding a local name
    would change nothing, so the entries are replaced inside the dict.
    """
    n = superbatch_size(batch)
    index = index.to(torch.long)
    idx_list = index.tolist()
    for key in per_sample_keys(batch, n):
        value = batch[key]
        if isinstance(value, torch.Tensor):
            batch[key] = value[index.to(value.device)]
        else:
            batch[key] = type(value)(value[i] for i in idx_list)
