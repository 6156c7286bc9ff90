"""Train a byte-level BPE ``tokenizer.json`` offline on the pool (and target), cached beside the token cache.

    selection-callbacks tokenizer --pool data/default/pool.jsonl --target data/default/target.jsonl \
        --vocab-size 4096
    # prints the cached path; train on it with --data.tokenizer PATH --model.config.vocab_size 4096

The tokenizer is GPT-2's recipe: the text's UTF-8 bytes as a 256-symbol alphabet (no unknown
tokens), GPT-2's pre-tokenizer split, merges learnt up to ``vocab_size`` ids with ``<|endoftext|>`` as
id 0 (the document boundary). It lands in ``<cache_dir>/tokenizers/<key>/tokenizer.json``, ``key``
hashing the settings and every source file's path, size and mtime, so a second run with the same
sources returns the first one's file; the val split is never read.
"""

from __future__ import annotations

import hashlib
import shutil
from collections.abc import Iterator
from pathlib import Path

from jsonargparse import ActionSubCommands, ArgumentParser, Namespace

from selection_callbacks.core.io import atomic_path
from selection_callbacks.data.cache import default_cache_dir
from selection_callbacks.data.readers import Columns, iter_documents, source_files

__all__ = ["BOUNDARY", "BPE_VERSION", "build_parser", "run", "train_bpe"]

BPE_VERSION = 1
BOUNDARY = "<|endoftext|>"


def bpe_key(sources: list[str], vocab_size: int, min_frequency: int, columns: Columns) -> str:
    """Cache key of a trained tokenizer: version, settings, text column and every source file's (path, size, mtime)."""
    h = hashlib.sha256(f"bpe-v{BPE_VERSION}|V={vocab_size}|min={min_frequency}|text={columns.text}".encode())
    for source in sources:
        for f in source_files(source):
            st = f.stat()
            h.update(f"|{f.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode())
    return h.hexdigest()[:20]


def _texts(sources: list[str], columns: Columns) -> Iterator[str]:
    for source in sources:
        for doc in iter_documents(source, columns):
            yield doc.text


def train_bpe(sources: list[str], vocab_size: int = 4096, cache_dir: str | Path | None = None,
              min_frequency: int = 2, columns: Columns = Columns(), progress: bool = True) -> Path:
    """Train (or find cached) a byte-level BPE on ``sources``; the ``tokenizer.json`` path."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + 1:
        raise ValueError(f"vocab_size must hold the {len(alphabet)} byte symbols and {BOUNDARY}: ≥ {len(alphabet) + 1}, "
                         f"got {vocab_size}")
    folder = Path(cache_dir or default_cache_dir()) / "tokenizers" / bpe_key(sources, vocab_size, min_frequency, columns)
    out = folder / "tokenizer.json"
    if out.is_file():
        return out
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=[BOUNDARY],
                                  initial_alphabet=alphabet, show_progress=progress)
    tok.train_from_iterator(_texts(sources, columns), trainer)
    folder.mkdir(parents=True, exist_ok=True)
    with atomic_path(out, ".json") as tmp:  # a concurrent run never reads a partial file
        tok.save(str(tmp))
    return out


def build_parser(parent: ActionSubCommands | None = None, name: str = "tokenizer") -> ArgumentParser:
    """The ``tokenizer`` command, standalone or as subcommand ``name`` of ``parent``."""
    description = __doc__.splitlines()[0]
    parser = ArgumentParser(prog="python -m selection_callbacks.data.bpe_training", description=description)
    parser.add_argument("--pool", required=True, help="pool source the merges are learnt from")
    parser.add_argument("--target", default=None, help="target source, learnt from as well (optional)")
    parser.add_argument("--vocab-size", type=int, default=4096, help="token ids, the boundary token included")
    parser.add_argument("--min-frequency", type=int, default=2, help="fewest occurrences of a pair to merge it")
    parser.add_argument("--text-column", default="text", help="row field holding the text")
    parser.add_argument("--cache-dir", default=None, help="default $SELECTION_CACHE or ~/.cache/selection_callbacks")
    parser.add_argument("--out", default=None, help="also copy the tokenizer.json here")
    if parent is not None:
        parent.add_subcommand(name, parser, help=description)
    return parser


def run(args: Namespace) -> int:
    """Train or reuse the tokenizer, print its path; 0."""
    sources = [args.pool] + ([args.target] if args.target else [])
    path = train_bpe(sources, args.vocab_size, args.cache_dir, args.min_frequency, Columns(text=args.text_column))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, args.out)
        path = Path(args.out)
    print(path)
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m selection_callbacks.data.bpe_training``: parse ``argv`` and train; the exit status."""
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
