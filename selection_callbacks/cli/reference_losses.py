"""Write a reference model's loss on every pool sequence once, for RHO-LOSS lookups by ``sample_id``.

    selection-callbacks reference-losses --ckpt runs/rho_reference/reference.ckpt \
        --pool data/default/pool.jsonl --seq-len 128 --out runs/rho_reference/pool_losses.npz

(``python -m selection_callbacks.cli.reference_losses`` takes the same arguments.)

``--ckpt`` is a ``LitGPT``/``LitCausalLM`` checkpoint or a Hugging Face ``save_pretrained`` folder
(:func:`~selection_callbacks.scoring.reference.load_reference`). The pool is packed exactly as
``PoolDataModule`` packs it (same tokenizer, same ``seq_len``, so sample ``s`` is the same sequence),
and ℓ_ref(s) is the reference's mean token loss on it. The file is a
:class:`~selection_callbacks.scoring.reference_losses.ReferenceLossTable`: ``RhoLossSelection(reference_losses=...)``
refuses it for another pool or ``seq_len`` (fingerprint, at setup) and for rows whose tokens differ
(row checksums, at every lookup).
"""

from __future__ import annotations

from pathlib import Path

import torch
from jsonargparse import ActionSubCommands, ArgumentParser, Namespace

from selection_callbacks.core.arguments import command_parser
from selection_callbacks.data.cache import default_cache_dir
from selection_callbacks.data.packing import PackedSplit, pack_source
from selection_callbacks.data.token_bin import load_token_bin
from selection_callbacks.scoring.proxy_models import check_reference_fits
from selection_callbacks.scoring.reference import load_reference
from selection_callbacks.scoring.reference_losses import ReferenceLossTable

__all__ = ["build_parser", "main", "pack_pool", "run"]


def pack_pool(pool: str, seq_len: int, cache_dir: str | None, eot_id: int) -> PackedSplit:
    """The pool packed as ``PoolDataModule`` packs it (text with the byte tokenizer, or a ``.bin`` of token ids)."""
    cache = cache_dir or default_cache_dir()
    if pool.endswith(".bin"):
        return load_token_bin(pool, seq_len, cache, eot_id, name="pool")
    return pack_source(pool, seq_len, cache, name="pool")


def build_parser(parent: ActionSubCommands | None = None, name: str = "reference-losses") -> ArgumentParser:
    """The ``reference-losses`` command, standalone or as subcommand ``name`` of ``parent``."""
    description = __doc__.split("\n\n")[0]
    p = command_parser("python -m selection_callbacks.cli.reference_losses", description, parent, name)
    p.add_argument("--ckpt", required=True,
                   help="the reference: a train.py checkpoint (trained on the target split) or a Hugging Face "
                        "model folder")
    p.add_argument("--pool", required=True, help="the training pool, as passed to --data.pool")
    p.add_argument("--seq-len", type=int, required=True, help="the training --data.seq_len")
    p.add_argument("--out", required=True, help="output .npz")
    p.add_argument("--batch-size", type=int, default=64, help="pool sequences per reference forward pass")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="torch device the reference runs on (cuda when this machine has one)")
    p.add_argument("--cache-dir", default=None, help="packed-token cache (default: as PoolDataModule)")
    p.add_argument("--eot-id", type=int, default=50256, help="for .bin pools: the end-of-text id")
    return p


def run(args: Namespace) -> Path:
    """Write the loss file a ``build_parser()`` namespace describes; returns its path."""
    module = load_reference(args.ckpt)
    split = pack_pool(args.pool, args.seq_len, args.cache_dir, args.eot_id)
    check_reference_fits(module, f"reference {args.ckpt!r}", data_vocab=int(split.tokens.max()) + 1,
                         seq_len=args.seq_len)
    table = ReferenceLossTable.of_pool(module, split, args.batch_size, torch.device(args.device))
    out = table.write(args.out)
    print(f"wrote {out}: {len(table.loss)} sequences, mean reference loss {float(table.loss.mean()):.4f} nats")
    return out


def main(argv: list[str] | None = None) -> Path:
    """``python -m selection_callbacks.cli.reference_losses``: parse ``argv``, write the file, return its path."""
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    main()
