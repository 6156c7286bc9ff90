"""ℓ_ref per row: a reference model's loss on every candidate, computed once and looked up by ``sample_id``.

RHO-LOSS reads a table with ``reference_losses=FILE`` instead of running its reference on every step.
A table is built from a packed pool (:meth:`ReferenceLossTable.of_pool`: what ``selection-callbacks
reference-losses`` writes) or from any iterable of superbatch dicts with ``sample_id`` [N] and
``input_ids`` [N, T] (:meth:`ReferenceLossTable.of_batches`: the rows of a DataModule of one's own).
The ``.npz`` holds ``sample_id`` [M] (int64, sorted), ``loss`` [M] (float32, the reference's mean
token loss of the row), ``checksum`` [M] (int64, of the row's ``input_ids``) and ``seq_len``; a
pool's table also holds the packed pool's ``fingerprint``.

The check that a table belongs to the rows it is asked about is the row checksum, which needs no
particular DataModule: every lookup recomputes c(x) = Σ_t x_t · w_t (exact int64 arithmetic, fixed
pseudo-random weights w_t ∈ [1, 2²⁰)) of each candidate's ``input_ids`` and compares it with the one
stored for its ``sample_id``, so rows of another pool, tokenizer, ``seq_len`` or packing are refused
at the first lookup, naming their ids. A pool's table is also compared with a ``PoolDataModule``'s
packed pool (:meth:`ReferenceLossTable.check_pool`, the fingerprint) at setup, before the first step.

Example::

    table = ReferenceLossTable.of_batches(reference, my_datamodule.train_dataloader())
    table.write("runs/reference/losses.npz")
    RhoLossSelection(ratio=0.5, reference_losses="runs/reference/losses.npz")
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from selection_callbacks.data.packing import PackedSplit
from selection_callbacks.scoring.losses import per_sample_loss

__all__ = ["ReferenceLossTable", "pool_fingerprint", "row_checksums"]

FINGERPRINT_TOKENS = 1 << 20
CHECKSUM_SEED = 0x5EED
FILE_FIELDS = ("sample_id", "loss", "checksum", "seq_len")
COMMAND = "selection-callbacks reference-losses --ckpt REF --pool POOL --seq-len T --out FILE"


def pool_fingerprint(split: PackedSplit) -> str:
    """sha256 over seq_len, stream length, document ids and offsets, and ≤ 2²⁰ tokens at an even stride."""
    h = hashlib.sha256(f"T={split.seq_len}|L={split.tokens.shape[0]}|S={len(split)}".encode())
    h.update("\n".join(str(d) for d in split.doc_ids).encode())
    h.update(np.ascontiguousarray(split.doc_start, dtype=np.int64).tobytes())
    stride = max(1, split.tokens.shape[0] // FINGERPRINT_TOKENS)
    h.update(np.ascontiguousarray(split.tokens[::stride]).tobytes())
    return h.hexdigest()[:32]


def row_checksums(input_ids: torch.Tensor) -> torch.Tensor:
    """[N] int64 c(x) = Σ_t x_t · w_t of each row of ``input_ids`` [N, T], on its device.

    The weights w_t ∈ [1, 2²⁰) are drawn once from a fixed seed, so every process and device gets the
    same checksum for the same row; products stay below 2⁴⁴ for ids < 2²⁴ and the sum below 2⁶² for
    T ≤ 2¹⁸, so the arithmetic is exact. Two rows that differ collide with probability ≤ 2⁻²⁰.
    """
    generator = torch.Generator().manual_seed(CHECKSUM_SEED)
    weights = torch.randint(1, 1 << 20, (input_ids.shape[1],), generator=generator, dtype=torch.int64)
    return (input_ids.long() * weights.to(input_ids.device)).sum(1)


@dataclass
class ReferenceLossTable:
    """ℓ_ref per ``sample_id``, with each row's checksum (the module docstring has the format and checks).

    Args:
        sample_id: int64 [M], sorted, unique.
        loss: float32 [M], the reference's mean token loss of each row.
        checksum: int64 [M], :func:`row_checksums` of each row's ``input_ids``.
        seq_len: T of the rows.
        fingerprint: the packed pool's :func:`pool_fingerprint` (None: rows of another DataModule).
        path: where the table was read from or written to (for errors).
    """

    sample_id: torch.Tensor
    loss: torch.Tensor
    checksum: torch.Tensor
    seq_len: int
    fingerprint: str | None = None
    path: str = "the reference loss table"

    @classmethod
    def read(cls, path: str | Path) -> ReferenceLossTable:
        """The table in ``path`` (an ``.npz`` :meth:`write` wrote; read without pickle)."""
        if not Path(path).is_file():
            raise FileNotFoundError(f"reference loss file {str(path)!r} does not exist; write it with {COMMAND} "
                                    "(or ReferenceLossTable.of_batches(...).write(FILE) for rows of your own "
                                    "DataModule)")
        with np.load(path, allow_pickle=False) as f:
            missing = [k for k in FILE_FIELDS if k not in f.files]
            if missing:
                raise ValueError(f"{str(path)!r} is not a reference loss file (lacks {missing}): write it again with "
                                 f"{COMMAND}")
            fingerprint = str(f["fingerprint"]) if "fingerprint" in f.files else None
            return cls(torch.from_numpy(f["sample_id"].astype(np.int64)),
                       torch.from_numpy(f["loss"].astype(np.float32)), torch.from_numpy(f["checksum"].astype(np.int64)),
                       int(f["seq_len"]), fingerprint, str(path))

    def write(self, path: str | Path) -> Path:
        """Save the table as ``path`` (.npz, the name kept exactly as given); returns the path."""
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        fields = {"sample_id": self.sample_id.numpy(), "loss": self.loss.numpy(), "checksum": self.checksum.numpy(),
                  "seq_len": np.int64(self.seq_len)}
        if self.fingerprint is not None:
            fields["fingerprint"] = np.str_(self.fingerprint)
        with out.open("wb") as f:  # a file object keeps the name exactly as given (np.savez would append .npz)
            np.savez(f, **fields)
        self.path = str(out)
        return out

    @classmethod
    def of_pool(cls, module: torch.nn.Module, split: PackedSplit, batch_size: int, device: torch.device,
                progress: bool = True) -> ReferenceLossTable:
        """``module.per_sample_loss`` of every sample of the packed ``split`` (ids 0 … S−1), with its fingerprint."""
        module = module.to(device).eval()
        loss = np.empty(len(split), dtype=np.float32)
        checksum = np.empty(len(split), dtype=np.int64)
        with torch.no_grad():
            for start in tqdm(range(0, len(split), batch_size), desc="reference losses", unit="batch",
                              disable=not progress):
                ids = np.arange(start, min(start + batch_size, len(split)))
                batch = {k: v.to(device) for k, v in split.batch(ids).items()}
                loss[ids] = per_sample_loss(module, batch).float().cpu().numpy()
                checksum[ids] = row_checksums(batch["input_ids"]).cpu().numpy()
        return cls(torch.arange(len(split)), torch.from_numpy(loss), torch.from_numpy(checksum), split.seq_len,
                   pool_fingerprint(split))

    @classmethod
    def of_batches(cls, module: torch.nn.Module, batches: Iterable[Mapping[str, torch.Tensor]],
                   device: torch.device | str = "cpu", progress: bool = True) -> ReferenceLossTable:
        """``module.per_sample_loss`` of every row of ``batches``: dicts with ``sample_id`` [N], ``input_ids`` [N, T].

        Raises:
            ValueError: a batch lacks ``sample_id``, its rows differ in T, or a ``sample_id`` comes twice.
        """
        module = module.to(device).eval()
        ids, losses, checksums, seq_len = [], [], [], None
        with torch.no_grad():
            for batch in tqdm(batches, desc="reference losses", unit="batch", disable=not progress):
                if not isinstance(batch.get("sample_id"), torch.Tensor):
                    raise ValueError("a reference loss table is keyed by sample_id: every batch needs a sample_id "
                                     "tensor [N]")
                rows = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
                if seq_len not in (None, rows["input_ids"].shape[1]):
                    raise ValueError(f"rows of {seq_len} and {rows['input_ids'].shape[1]} tokens: a table holds "
                                     "rows of one T")
                seq_len = rows["input_ids"].shape[1]
                ids.append(batch["sample_id"].long().cpu())
                losses.append(per_sample_loss(module, rows).float().cpu())
                checksums.append(row_checksums(rows["input_ids"]).cpu())
        sample_id, order = torch.sort(torch.cat(ids))
        twice = sample_id[1:][sample_id[1:] == sample_id[:-1]]
        if twice.numel():
            raise ValueError(f"sample_id(s) {twice.unique()[:5].tolist()} come more than once: pass each row once "
                             "(one epoch of the loader)")
        return cls(sample_id, torch.cat(losses)[order], torch.cat(checksums)[order], int(seq_len or 0))

    def check_pool(self, split: PackedSplit) -> None:
        """A clear error unless a pool's table was made for this packed pool and seq_len (other tables: no check)."""
        if self.fingerprint is None:
            return
        if split.seq_len != self.seq_len:
            raise ValueError(f"{self.path} was made for seq_len={self.seq_len}, the pool is packed at {split.seq_len}")
        if len(split) != self.sample_id.shape[0] or pool_fingerprint(split) != self.fingerprint:
            raise ValueError(
                f"{self.path} was made for another pool ({self.sample_id.shape[0]} sequences, fingerprint "
                f"{self.fingerprint}); this pool has {len(split)} sequences, fingerprint {pool_fingerprint(split)}: "
                "recompute it for this pool"
            )

    def lookup(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """[N] ℓ_ref of the batch's rows, by ``sample_id``, on its device; each row's checksum must match.

        Raises:
            KeyError: a ``sample_id`` the table does not hold.
            ValueError: rows of another length, or rows whose tokens are not those the table was made from.
        """
        ids = batch["sample_id"].long().cpu()
        if batch["input_ids"].shape[1] != self.seq_len:
            raise ValueError(f"{self.path} holds rows of seq_len={self.seq_len}, the superbatch's rows have "
                             f"{batch['input_ids'].shape[1]} tokens: recompute it for this data")
        pos = torch.searchsorted(self.sample_id, ids).clamp_max(max(self.sample_id.shape[0] - 1, 0))
        absent = self.sample_id[pos] != ids
        if absent.any():
            raise KeyError(f"sample_id(s) {ids[absent][:5].tolist()} are not in {self.path} ({self.sample_id.shape[0]} "
                           "rows): the table was made for other data; recompute it for these rows")
        other = row_checksums(batch["input_ids"]).cpu() != self.checksum[pos]
        if other.any():
            raise ValueError(f"{self.path}: the rows of sample_id(s) {ids[other][:5].tolist()} hold other tokens than "
                             "the rows the table was made from (another pool, tokenizer, seq_len or packing): "
                             "recompute it for this data")
        out = self.loss[pos]
        if not torch.isfinite(out).all():
            missing = ids[~torch.isfinite(out)][:5].tolist()
            raise ValueError(f"{self.path} has no finite loss for sample_id(s) {missing}")
        return out.to(batch["sample_id"].device)
