"""One command line: ``selection-callbacks`` and ``python -m selection_callbacks`` with a subcommand per
tool, the old ``python -m`` paths beside them, and the bench tools, all jsonargparse with a help line per option.

Every subcommand's ``--help`` runs in-process (fast) and in a subprocess through an installed entry
point; the subprocesses run in parallel (each start-up imports torch).
"""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys
from argparse import SUPPRESS, _HelpAction
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from jsonargparse import ActionSubCommands, ArgumentParser

from selection_callbacks.cli import TOOLS, build_parser, exit_status, main

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = shutil.which("selection-callbacks", path=str(Path(sys.executable).parent)) or str(
    Path(sys.executable).parent / "selection-callbacks")
NEW = {"script": [SCRIPT], "module": [sys.executable, "-m", "selection_callbacks"]}
ENV = {**os.environ, "COLUMNS": "200"}  # wide help, so no line breaks inside a help text

SELECTORS = ("dsir", "warmup_delta", "policy", "datamask", "autodata", "oracle")
PATHS = [
    ("select",), *(("select", s) for s in SELECTORS),
    ("autodata",), ("autodata", "search"), ("autodata", "report"), ("autodata", "schema"),
    ("ledger",), ("ledger", "export"), ("ledger", "summary"),
    ("reference-losses",), ("bench-docs",), ("corpus",), ("packages",), ("debian",), ("tokenizer",),
]
# (entry point, subcommand path): each path runs once, each top-level tool through both entry points
NEW_RUNS = [
    ("script", ()), ("script", ("select",)), ("script", ("select", "dsir")), ("script", ("select", "policy")),
    ("module", ("select", "warmup_delta")), ("module", ("select", "datamask")), ("module", ("select", "autodata")),
    ("script", ("select", "oracle")),
    ("script", ("autodata",)), ("script", ("autodata", "search")), ("script", ("autodata", "schema")),
    ("module", ("autodata", "report")),
    ("script", ("ledger",)), ("script", ("ledger", "export")), ("module", ("ledger", "summary")),
    ("script", ("reference-losses",)), ("module", ("reference-losses",)),
    ("script", ("bench-docs",)), ("module", ("bench-docs",)), ("script", ("corpus",)), ("module", ("corpus",)),
    ("script", ("packages",)), ("module", ("packages",)), ("script", ("debian",)), ("module", ("debian",)),
    ("script", ("tokenizer",)), ("module", ("tokenizer",)),
]
# old module path (+ its sub-subcommand) → the subcommand path holding the same parser
OLD_RUNS = [
    (("selection_callbacks.offline.select", "dsir"), ("select", "dsir")),
    (("selection_callbacks.offline.autodata", "search"), ("autodata", "search")),
    (("selection_callbacks.cli.ledger", "summary"), ("ledger", "summary")),
    (("selection_callbacks.cli.ledger", "export"), ("ledger", "export")),
    (("selection_callbacks.cli.reference_losses",), ("reference-losses",)),
    (("selection_callbacks.offline.bench_docs",), ("bench-docs",)),
    (("selection_callbacks.data.default_corpus",), ("corpus",)),
    (("selection_callbacks.data.default_corpus",), ("corpus",)),
    (("selection_callbacks.data.package_corpus",), ("packages",)),
    (("selection_callbacks.data.debian_corpus",), ("debian",)),
]
BENCH = ("harness.compare", "studies.datamask_scale", "harness.equal_wall", "studies.ghost", "harness.headline", "studies.sketch_error",
         "harness.steptime", "studies.utility_ranking")


def _flat(text: str) -> str:
    return " ".join(text.replace("%%", "%").split())


def _children(parser: ArgumentParser) -> dict[str, ArgumentParser]:
    action = parser._subcommands_action
    return {} if action is None else dict(action._name_parser_map)


def _parser_at(path: tuple[str, ...]) -> ArgumentParser:
    parser = build_parser()
    for name in path:
        parser = _children(parser)[name]
    return parser


def _help_texts(parser: ArgumentParser) -> list[str]:
    """Every option's and positional's help, and each subcommand's line; each must be a real description."""
    texts = []
    for action in parser._actions:
        if isinstance(action, _HelpAction) or action.help == SUPPRESS:
            continue
        if isinstance(action, ActionSubCommands):
            texts += [choice.help for choice in action._choices_actions]
            continue
        assert action.help and action.help.strip(), f"{action.option_strings or action.dest} has no help"
        texts.append(action.help)
    return texts


def _assert_lists(out: str, parser: ArgumentParser) -> None:
    flat = _flat(out)
    missing = [t for t in _help_texts(parser) if _flat(t) not in flat]
    assert not missing, missing


def _run(argv: list[str]) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(argv, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    except FileNotFoundError as e:  # the console script is missing: the assertion names it
        return subprocess.CompletedProcess(argv, 127, "", f"{e} (install the package: pip install -e .)")


@pytest.fixture(scope="module")
def help_runs() -> dict[tuple[str, ...], subprocess.CompletedProcess]:
    """Every subprocess ``--help`` of this file, run in parallel once."""
    argvs = [tuple(NEW[entry] + list(path) + ["--help"]) for entry, path in NEW_RUNS]
    argvs += [(sys.executable, "-m", *old, "--help") for old, _ in OLD_RUNS]
    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as pool:
        return dict(zip(argvs, pool.map(lambda a: _run(list(a)), argvs)))


def test_the_paths_are_every_subcommand() -> None:
    def walk(parser: ArgumentParser, prefix: tuple[str, ...]) -> list[tuple[str, ...]]:
        return [p for name, sub in _children(parser).items() for p in [(*prefix, name), *walk(sub, (*prefix, name))]]

    assert sorted(walk(build_parser(), ())) == sorted(PATHS)
    assert set(TOOLS) == {p[0] for p in PATHS}
    assert {path for _, path in NEW_RUNS} == {(), *PATHS}
    assert {(entry, path[0]) for entry, path in NEW_RUNS if path} == {(e, t) for e in NEW for t in TOOLS}


@pytest.mark.parametrize("path", [(), *PATHS], ids=lambda p: " ".join(p) or "top")
def test_help_in_process_lists_every_option(path: tuple[str, ...], capsys, monkeypatch) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    with pytest.raises(SystemExit) as done:
        main([*path, "--help"])
    assert done.value.code == 0
    _assert_lists(capsys.readouterr().out, _parser_at(path))


@pytest.mark.parametrize("entry,path", NEW_RUNS, ids=lambda x: " ".join(x) if isinstance(x, tuple) else x)
def test_entry_point_help(entry: str, path: tuple[str, ...], help_runs) -> None:
    done = help_runs[tuple(NEW[entry] + list(path) + ["--help"])]
    assert done.returncode == 0, done.stderr
    prog = "selection-callbacks" if entry == "script" else "python -m selection_callbacks"
    assert done.stdout.startswith(f"usage: {prog}")
    _assert_lists(done.stdout, _parser_at(path))


@pytest.mark.parametrize("old,path", OLD_RUNS, ids=lambda x: " ".join(x))
def test_old_path_help(old: tuple[str, ...], path: tuple[str, ...], help_runs) -> None:
    done = help_runs[(sys.executable, "-m", *old, "--help")]
    assert done.returncode == 0, done.stderr
    _assert_lists(done.stdout, _parser_at(path))


@pytest.mark.parametrize("tool", BENCH)
def test_bench_tool_help(tool: str, capsys, monkeypatch) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    module = importlib.import_module(f"bench.{tool}")
    parser = module.build_parser()
    assert isinstance(parser, ArgumentParser)  # jsonargparse's, as every command
    with pytest.raises(SystemExit) as done:
        module.main(["--help"])
    assert done.value.code == 0
    _assert_lists(capsys.readouterr().out, parser)


def test_exit_status(tmp_path: Path, capsys) -> None:
    assert main(["ledger", "export", str(tmp_path), "--out", str(tmp_path / "x.jsonl")]) == 1
    assert "name the output *.parquet" in capsys.readouterr().err
    assert exit_status({"documents": 3}) == 0 and exit_status(None) == 0 and exit_status(2) == 2
    with pytest.raises(SystemExit) as done:
        main(["select", "nope"])
    assert done.value.code == 2


def test_new_command_builds_what_the_old_path_builds(tmp_path: Path) -> None:
    commands = [[SCRIPT, "corpus", "--out", str(tmp_path / "new")],
                [sys.executable, "-m", "selection_callbacks.data.default_corpus", "--out", str(tmp_path / "old")]]
    with ThreadPoolExecutor(max_workers=2) as pool:
        runs = list(pool.map(_run, commands))
    for done in runs:
        assert done.returncode == 0, done.stderr
        assert "| domain |" in done.stdout
    for name in ("pool.jsonl", "target.jsonl", "val.jsonl", "card.json"):
        assert (tmp_path / "new" / name).read_bytes() == (tmp_path / "old" / name).read_bytes(), name
