"""Per-micro-batch random streams derived from (seed, epoch, batch index, purpose).

Nothing random is carried between steps, so resume and DDP need no RNG state: every rank and
every restart derives the same generator for the same micro-batch.
"""

from __future__ import annotations

import zlib

import numpy as np
import torch


def derived_seed(seed: int, epoch: int, batch_idx: int, purpose: str = "select") -> int:
    """A 63-bit seed from the tuple, stable across processes and Python versions."""
    entropy = [int(seed) & 0xFFFFFFFF, int(epoch), int(batch_idx), zlib.crc32(purpose.encode())]
    hi, lo = (int(x) for x in np.random.SeedSequence(entropy).generate_state(2, dtype=np.uint32))
    return ((hi & 0x7FFFFFFF) << 32) | lo


def micro_batch_generator(seed: int, epoch: int, batch_idx: int, purpose: str = "select") -> torch.Generator:
    """CPU ``torch.Generator`` for one micro-batch and purpose."""
    return torch.Generator().manual_seed(derived_seed(seed, epoch, batch_idx, purpose))
