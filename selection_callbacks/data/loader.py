"""A resumable superbatch loader with rank sharding of one global superbatch."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from selection_callbacks.data.packing import PackedSplit
from selection_callbacks.data.subset import repeat_counts


class _SuperbatchDataset(Dataset):
    """Superbatch ``b`` of one epoch's order, this rank's slice."""

    def __init__(self, split: PackedSplit, order: np.ndarray, size: int, rank: int, world_size: int) -> None:
        self.split, self.order, self.size, self.rank, self.world = split, order, size, rank, world_size

    def __len__(self) -> int:
        return len(self.order) // (self.size * self.world)

    def __getitem__(self, b: int) -> dict[str, torch.Tensor]:
        start = (b * self.world + self.rank) * self.size
        return self.split.batch(self.order[start : start + self.size])


class SuperbatchLoader:
    """Yields superbatches of ``superbatch_size`` sequences per rank, resumable mid-epoch.

    Epoch ``e`` shuffles the candidate ids with ``default_rng([seed, e])``; global superbatch ``b``
    is ``order[b·W·N : (b+1)·W·N]`` and rank ``r`` gets its ``r``-th N-slice, so a W-process run
    sees exactly the superbatches of a single process with superbatch ``W·N``. Lightning saves
    and restores :meth:`state_dict` (epoch, batches consumed) with each checkpoint.

    Args:
        split: packed pool.
        sample_ids: candidate ids (the whole pool, or a subset).
        superbatch_size: N per rank.
        seed: shuffling seed.
        weights: optional repeat counts per candidate (subset ``weight``).
        rank, world_size: this process's shard.
        num_workers: DataLoader workers that read the windows (ids do not depend on it).
    """

    def __init__(
        self,
        split: PackedSplit,
        sample_ids: np.ndarray,
        superbatch_size: int,
        seed: int = 0,
        weights: np.ndarray | None = None,
        rank: int = 0,
        world_size: int = 1,
        num_workers: int = 0,
    ) -> None:
        self.split = split
        self.sample_ids = np.asarray(sample_ids, dtype=np.int64)
        self.superbatch_size = superbatch_size
        self.seed = seed
        self.weights = weights
        self.rank, self.world_size = rank, world_size
        self.num_workers = num_workers
        self.epoch = 0
        self.position = 0
        if len(self) == 0:
            raise ValueError(
                f"the pool has {len(self.sample_ids)} sequences, fewer than one global superbatch of "
                f"{superbatch_size}×{world_size}; add data or lower data.batch_size / raise data.ratio"
            )

    def epoch_order(self, epoch: int) -> np.ndarray:
        """Candidate ids of ``epoch`` in training order."""
        ids = self.sample_ids
        if self.weights is not None:
            ids = np.repeat(ids, repeat_counts(self.weights, np.random.default_rng([self.seed, epoch, 1])))
        return ids[np.random.default_rng([self.seed, epoch]).permutation(len(ids))]

    def __len__(self) -> int:
        n = len(self.sample_ids) if self.weights is None else int(np.floor(self.weights.sum()))  # an epoch's minimum
        return n // (self.superbatch_size * self.world_size)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        if self.position >= len(self):
            self.epoch, self.position = self.epoch + 1, 0
        ds = _SuperbatchDataset(self.split, self.epoch_order(self.epoch), self.superbatch_size, self.rank, self.world_size)
        n = min(len(self), len(ds))
        loader = DataLoader(ds, batch_size=None, sampler=range(self.position, n), num_workers=self.num_workers)
        for batch in loader:
            self.position += 1
            yield batch
        self.epoch, self.position = self.epoch + 1, 0

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("seed", self.seed) != self.seed:
            raise ValueError(f"checkpoint loader seed {state['seed']} differs from data.seed {self.seed}")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
