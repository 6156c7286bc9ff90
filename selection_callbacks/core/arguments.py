"""Pieces the command-line tools share: a tool's parser that may be a subcommand, and the pool/target/budget options."""

from __future__ import annotations

from jsonargparse import ActionSubCommands, ArgumentParser

__all__ = ["add_pool_arguments", "command_parser"]


def command_parser(prog: str, description: str, parent: ActionSubCommands | None, name: str) -> ArgumentParser:
    """A tool's parser, attached as subcommand ``name`` of ``parent`` when given (before its own subcommands, as jsonargparse requires)."""
    parser = ArgumentParser(prog=prog, description=description)
    if parent is not None:
        parent.add_subcommand(name, parser, help=description)
    return parser


def add_pool_arguments(parser: ArgumentParser, target_help: str, tokens_help: str, docs_help: str) -> None:
    """``--pool``, ``--target`` and exactly one of ``--budget-tokens`` / ``--budget-docs``."""
    parser.add_argument("--pool", required=True, help="candidate documents (jsonl, parquet or a folder of text)")
    parser.add_argument("--target", required=True, help=target_help)
    budget = parser.add_mutually_exclusive_group(required=True)
    budget.add_argument("--budget-tokens", type=int, help=tokens_help)
    budget.add_argument("--budget-docs", type=int, help=docs_help)
