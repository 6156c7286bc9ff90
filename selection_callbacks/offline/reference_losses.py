"""Precompute a reference model's loss on every pool sequence once, for RHO-LOSS lookups by ``sample_id``.

    selection-callbacks reference-losses --ckpt runs/rho_reference/reference.ckpt \
        --pool data/default/pool.jsonl --seq-len 128 --out runs/rho_reference/pool_losses.npz

(``python -m selection_callbacks.offline.reference_losses`` takes the same arguments.)

The pool is packed exactly as ``PoolDataModule`` packs it (same tokenizer, same ``seq_len``, so
sample ``s`` is the same sequence), and ℓ_ref(s) is the reference's mean token loss on it. The
``.npz`` holds ``loss`` [S] (float32, indexed by sample_id), ``seq_len`` and ``fingerprint`` (of
the packed pool): ``RhoLossSelection(reference_losses=...)`` refuses a file made for another pool
or ``seq_len``.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import torch
from jsonargparse import ActionSubCommands, ArgumentParser, Namespace
from tqdm.auto import tqdm

from selection_callbacks.data.cache import default_cache_dir
from selection_callbacks.data.packing import PackedSplit, pack_source
from selection_callbacks.data.token_bin import load_token_bin
from selection_callbacks.scoring.losses import per_sample_loss
from selection_callbacks.scoring.reference import load_reference
from selection_callbacks.core.pass_counts import CostMeter
from selection_callbacks.nn.gpt import GPTConfig
from selection_callbacks.scoring.proxy_models import Proxy, ProxyLM, check_reference_fits, pretrain_on_target, seeded_proxy

FINGERPRINT_TOKENS = 1 << 20


def pool_fingerprint(split: PackedSplit) -> str:
    """sha256 over seq_len, stream length, document ids and offsets, and ≤ 2²⁰ tokens at an even stride."""
    h = hashlib.sha256(f"T={split.seq_len}|L={split.tokens.shape[0]}|S={len(split)}".encode())
    h.update("\n".join(str(d) for d in split.doc_ids).encode())
    h.update(np.ascontiguousarray(split.doc_start, dtype=np.int64).tobytes())
    stride = max(1, split.tokens.shape[0] // FINGERPRINT_TOKENS)
    h.update(np.ascontiguousarray(split.tokens[::stride]).tobytes())
    return h.hexdigest()[:32]


class ReferenceLossTable:
    """ℓ_ref per pool sample, read from a file written by this module.

    Args:
        path: the ``.npz`` file.
    """

    def __init__(self, path: str | Path) -> None:
        if not Path(path).is_file():
            raise FileNotFoundError(
                f"reference loss file {str(path)!r} does not exist; write it with "
                "python -m selection_callbacks.offline.reference_losses --ckpt REF --pool POOL --seq-len T --out FILE"
            )
        with np.load(path, allow_pickle=False) as f:
            missing = {"loss", "seq_len", "fingerprint"} - set(f.files)
            if missing:
                raise ValueError(f"{str(path)!r} is not a reference loss file (lacks {sorted(missing)})")
            self.loss = torch.from_numpy(f["loss"].astype(np.float32))
            self.seq_len = int(f["seq_len"])
            self.fingerprint = str(f["fingerprint"])
        self.path = str(path)

    def check_pool(self, split: PackedSplit) -> None:
        """A clear error unless the file was made for this packed pool and seq_len."""
        if split.seq_len != self.seq_len:
            raise ValueError(f"{self.path} was made for seq_len={self.seq_len}, the pool is packed at {split.seq_len}")
        if len(split) != self.loss.shape[0] or pool_fingerprint(split) != self.fingerprint:
            raise ValueError(
                f"{self.path} was made for another pool ({self.loss.shape[0]} sequences, fingerprint "
                f"{self.fingerprint}); this pool has {len(split)} sequences, fingerprint {pool_fingerprint(split)}: "
                "recompute it for this pool"
            )

    def lookup(self, sample_id: torch.Tensor) -> torch.Tensor:
        """[N] ℓ_ref of the given sample ids (on their device); an unknown id is an error."""
        ids = sample_id.long().cpu()
        bad = (ids < 0) | (ids >= self.loss.shape[0])
        if bad.any():
            raise KeyError(
                f"sample_id(s) {ids[bad][:5].tolist()} are not in {self.path} ({self.loss.shape[0]} pool sequences): "
                "the file was made for another pool"
            )
        out = self.loss[ids]
        if not torch.isfinite(out).all():
            missing = ids[~torch.isfinite(out)][:5].tolist()
            raise ValueError(f"{self.path} has no finite loss for sample_id(s) {missing}")
        return out.to(sample_id.device)


def reference_losses(module: torch.nn.Module, split: PackedSplit, batch_size: int, device: torch.device,
                     progress: bool = True) -> np.ndarray:
    """float32 [S]: ``module.per_sample_loss`` of every sample of ``split``, in sample_id order."""
    module = module.to(device).eval()
    out = np.empty(len(split), dtype=np.float32)
    with torch.no_grad():
        starts = range(0, len(split), batch_size)
        for start in tqdm(starts, desc="reference losses", unit="batch", disable=not progress):
            ids = np.arange(start, min(start + batch_size, len(split)))
            batch = {k: v.to(device) for k, v in split.batch(ids).items()}
            out[ids] = per_sample_loss(module, batch).float().cpu().numpy()
    return out


def pretrained_reference(datamodule: object, config: GPTConfig, steps: int, batch_size: int, lr: float, seed: int) -> ProxyLM:
    """The reference RHO-LOSS (and ClassAct's paper variant) pretrains when given no checkpoint, outside a run.

    The proxy of (``seed``, "reference") with ``config`` (the selector's ``proxy_config``), trained for
    ``steps`` AdamW steps at ``lr`` on ``datamodule.target_batch`` draws seeded as in the run: the same
    weights as the live reference, so a table of its losses selects as the live run does.
    """
    proxy = Proxy("reference", seeded_proxy(config, seed, "reference"), CostMeter(), lr)
    pretrain_on_target(proxy, datamodule, steps, batch_size, seed)
    return proxy.module


def write_loss_table(loss: np.ndarray, split: PackedSplit, out: str | Path) -> Path:
    """``out`` (.npz) holding ``loss`` [S] for the packed pool ``split``, its seq_len and fingerprint."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("wb") as f:  # a file object keeps the name exactly as given (np.savez would append .npz)
        np.savez(f, loss=loss, seq_len=np.int64(split.seq_len), fingerprint=np.str_(pool_fingerprint(split)))
    return out


def pack_pool(pool: str, seq_len: int, cache_dir: str | None, eot_id: int) -> PackedSplit:
    """The pool packed as ``PoolDataModule`` packs it (text with the byte tokenizer, or a ``.bin`` of token ids)."""
    cache = cache_dir or default_cache_dir()
    if pool.endswith(".bin"):
        return load_token_bin(pool, seq_len, cache, eot_id, name="pool")
    return pack_source(pool, seq_len, cache, name="pool")


def build_parser(parent: ActionSubCommands | None = None, name: str = "reference-losses") -> ArgumentParser:
    """The ``reference-losses`` command, standalone or as subcommand ``name`` of ``parent``."""
    description = __doc__.split("\n\n")[0]
    p = ArgumentParser(prog="python -m selection_callbacks.offline.reference_losses", description=description)
    p.add_argument("--ckpt", required=True, help="reference checkpoint (train.py on the target split)")
    p.add_argument("--pool", required=True, help="the training pool, as passed to --data.pool")
    p.add_argument("--seq-len", type=int, required=True, help="the training --data.seq_len")
    p.add_argument("--out", required=True, help="output .npz")
    p.add_argument("--batch-size", type=int, default=64, help="pool sequences per reference forward pass")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="torch device the reference runs on (cuda when this machine has one)")
    p.add_argument("--cache-dir", default=None, help="packed-token cache (default: as PoolDataModule)")
    p.add_argument("--eot-id", type=int, default=50256, help="for .bin pools: the end-of-text id")
    if parent is not None:
        parent.add_subcommand(name, p, help=description)
    return p


def run(args: Namespace) -> Path:
    """Write the loss file a ``build_parser()`` namespace describes; returns its path."""
    module = load_reference(args.ckpt)
    split = pack_pool(args.pool, args.seq_len, args.cache_dir, args.eot_id)
    check_reference_fits(module, int(split.tokens.max()) + 1, args.seq_len, f"reference {args.ckpt!r}")
    loss = reference_losses(module, split, args.batch_size, torch.device(args.device))
    out = write_loss_table(loss, split, args.out)
    print(f"wrote {out}: {len(loss)} sequences, mean reference loss {loss.mean():.4f} nats")
    return out


def main(argv: list[str] | None = None) -> Path:
    """``python -m selection_callbacks.offline.reference_losses``: parse ``argv``, write the file, return its path."""
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    main()
