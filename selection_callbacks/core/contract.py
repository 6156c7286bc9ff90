"""The superbatch contract: validate a dict batch, name its per-sample entries and subset them in place.

Which entries are per sample is declared, never guessed from a length: the keys of the contract
(:data:`CONTRACT_KEYS`) and those a datamodule or a selection callback names in ``per_sample_keys``.
Entries named in ``whole_batch_keys`` belong to the superbatch as a whole and pass through uncut;
an entry that is neither and has N rows is an error, since cutting it or not would be a guess.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, MutableMapping, Sequence
from typing import Any

import numpy as np
import torch

__all__ = [
    "CONTRACT_KEYS", "SuperbatchError", "nonfinite_rows", "per_sample_keys", "rows_of", "subset_in_place",
    "superbatch_size",
]

CONTRACT_KEYS = ("input_ids", "labels", "loss_mask", "sample_id", "domain")
"""The per-sample entries every superbatch may carry: ``input_ids`` [N, T] (required), ``labels`` and
``loss_mask`` [N, T], ``sample_id`` and ``domain`` [N] (``domain`` also as N strings)."""


class SuperbatchError(ValueError):
    """A batch that does not follow the superbatch contract."""


def rows_of(value: Any) -> int | None:
    """Rows of an entry that could be per sample: a tensor's or array's first dimension, a list's or tuple's length."""
    if isinstance(value, torch.Tensor | np.ndarray):
        return int(value.shape[0]) if value.ndim >= 1 else None
    if isinstance(value, list | tuple):
        return len(value)
    return None


def superbatch_size(batch: Any, per_sample: Iterable[str] = CONTRACT_KEYS) -> int:
    """N of a superbatch whose ``per_sample`` entries each have N rows.

    Raises:
        SuperbatchError: not a dict, no 2-D ``input_ids``, or a ``per_sample`` entry of another length; it names which.
    """
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
    for key in per_sample:
        value = batch.get(key)
        if value is None or rows_of(value) == n:
            continue
        shape = f"shape {tuple(value.shape)}" if hasattr(value, "shape") else f"{type(value).__name__} {value!r:.40}"
        raise SuperbatchError(f"'{key}' has {shape}, expected first dimension N={n}: a per-sample entry holds one "
                              "row per candidate")
    return n


def per_sample_keys(
    batch: Mapping[str, Any], n: int, declared: Iterable[str] = CONTRACT_KEYS, whole_batch: Iterable[str] = ()
) -> list[str]:
    """The declared per-sample keys ``batch`` holds, in its order.

    Raises:
        SuperbatchError: an entry neither declared per sample nor whole-batch has N rows (a tensor, an
            array, a list or a tuple): the message names it and both declarations.
    """
    declared, whole_batch = set(declared), set(whole_batch)
    undeclared = [key for key, value in batch.items()
                  if key not in declared and key not in whole_batch and rows_of(value) == n]
    if undeclared:
        one = len(undeclared) == 1
        raise SuperbatchError(
            f"the superbatch's {', '.join(repr(key) for key in undeclared)} {'has' if one else 'have'} N={n} rows but "
            f"{'is' if one else 'are'} not declared (per-sample keys: {sorted(declared)}): "
            "declare an entry that holds one row per candidate in per_sample_keys (an attribute of the datamodule, "
            "or SelectionCallback(per_sample_keys=[...])) so the K kept rows are cut from it, or one that belongs to "
            "the whole batch in whole_batch_keys (the same two places) so it passes through uncut"
        )
    return [key for key in batch if key in declared]


def nonfinite_rows(batch: Mapping[str, Any], keys: Sequence[str]) -> tuple[torch.Tensor | None, list[str]]:
    """[N] bool of the rows holding a NaN or inf in any floating entry among ``keys``, and those entries' keys.

    (None, []) when every value is finite. Integer and bool entries are finite by type and are not read.
    """
    bad, where = None, []
    for key in keys:
        value = batch[key]
        if isinstance(value, np.ndarray) and np.issubdtype(value.dtype, np.floating):
            value = torch.from_numpy(value)
        if not isinstance(value, torch.Tensor) or not (value.is_floating_point() or value.is_complex()):
            continue
        rows = ~torch.isfinite(value).reshape(value.shape[0], -1).all(1).cpu()
        if rows.any():
            bad = rows if bad is None else bad | rows
            where.append(key)
    return bad, where


def subset_in_place(batch: MutableMapping, index: torch.Tensor, keys: Iterable[str]) -> None:
    """Keep rows ``index`` of the per-sample entries ``keys`` (tensors, arrays, lists, tuples), mutating ``batch`` itself.

    Lightning passes the same dict object on to ``training_step``; rebinding a local name
    would change nothing, so the entries are replaced inside the dict.
    """
    index = index.to(torch.long)
    idx_list = index.tolist()
    for key in keys:
        value = batch[key]
        if isinstance(value, torch.Tensor):
            batch[key] = value[index.to(value.device)]
        elif isinstance(value, np.ndarray):
            batch[key] = value[np.asarray(idx_list, dtype=np.int64)]
        else:
            batch[key] = type(value)(value[i] for i in idx_list)
