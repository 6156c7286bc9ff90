"""The ``selection-callbacks`` command: one subcommand per library tool, one argument style (jsonargparse).

    selection-callbacks select dsir --pool data/default/pool.jsonl --target data/default/target.jsonl \
        --budget-tokens 2000000 --out runs/dsir/subset.parquet
    selection-callbacks autodata search|report|schema ...
    selection-callbacks ledger summary|export RUN_DIR ...
    selection-callbacks reference-losses --ckpt REF.ckpt --pool POOL --seq-len T --out FILE.npz
    selection-callbacks bench-docs --pool POOL --target TARGET --budget-tokens B --out DOCS.jsonl
    selection-callbacks corpus --out data/default
    selection-callbacks packages --out data/packages
    selection-callbacks debian --out data/debian
    selection-callbacks tokenizer --pool POOL --target TARGET --vocab-size 4096
    selection-callbacks <subcommand> [<sub-subcommand>] --help      # every option, with its help

``python -m selection_callbacks`` is the same command. Each subcommand's parser is its tool's own
``build_parser()``, so ``selection-callbacks select dsir ...`` and ``python -m
selection_callbacks.offline.select dsir ...`` take the same flags. A tool module loads only when its
subcommand runs (or for the full ``--help``), so ``selection-callbacks corpus`` never imports torch.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence
from typing import Any

from jsonargparse import ArgumentParser

__all__ = ["TOOLS", "build_parser", "exit_status", "main"]

PROG = "selection-callbacks"

TOOLS: dict[str, str] = {
    "select": "selection_callbacks.offline.select",
    "autodata": "selection_callbacks.offline.autodata.search",
    "ledger": "selection_callbacks.cli.ledger",
    "reference-losses": "selection_callbacks.cli.reference_losses",
    "bench-docs": "selection_callbacks.offline.bench_docs",
    "corpus": "selection_callbacks.data.default_corpus",
    "packages": "selection_callbacks.data.package_corpus",
    "debian": "selection_callbacks.data.debian_corpus",
    "tokenizer": "selection_callbacks.data.bpe_training",
}
"""Subcommand → the module holding its ``build_parser(parent, name)`` and ``run(namespace)``."""


def build_parser(prog: str = PROG, only: str | None = None) -> ArgumentParser:
    """The top-level parser; with ``only``, the other tools get empty stand-ins (their modules stay unloaded)."""
    parser = ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    sub = parser.add_subcommands(dest="tool", required=True)
    for name, module in TOOLS.items():
        if only is None or name == only:
            importlib.import_module(module).build_parser(sub, name)
        else:
            sub.add_subcommand(name, ArgumentParser(), help=f"(see {prog} {name} --help)")
    return parser


def exit_status(result: Any) -> int:
    """A tool's result as an exit status: an int is one (ledger, corpus), anything else means success."""
    return result if isinstance(result, int) and not isinstance(result, bool) else 0


def main(argv: Sequence[str] | None = None, prog: str = PROG) -> int:
    """Parse ``argv`` (default: the command line), run the named tool and return the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    only = argv[0] if argv and argv[0] in TOOLS else None
    parser = build_parser(prog, only)
    ns = parser.instantiate(parser.parse_args(argv))
    tool = importlib.import_module(TOOLS[ns.tool])
    return exit_status(tool.run(ns[ns.tool]))
