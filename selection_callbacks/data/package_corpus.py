"""Build a second visible corpus offline from the text that ships inside pip-installed packages.

The *target* (and its validation split) is Python source code of a few installed projects; the
*pool* mixes seven domains drawn from the *other* installed projects, the target's domain rare in
it (about a ninth of its bytes):

- ``python``: Python source (the target's domain, from different projects);
- ``stubs``: ``.pyi`` type stubs, Python-shaped but bodiless (a near miss);
- ``native``: C, C++, CUDA and Cython sources and headers (code, another language);
- ``docs``: READMEs, package descriptions (``METADATA``), Markdown and reStructuredText;
- ``licenses``: licence, notice and author files, many near-copies of each other;
- ``manifests``: wheel ``RECORD`` files and other install manifests, paths and hashes (junk);
- ``data``: JSON, CSV, YAML, TOML, font metrics and other data files.

Projects are held out whole: the target's and val's projects contribute nothing to the pool, so a
selector must find *Python* rather than a project it has seen. Which projects are held out is
drawn from ``seed``; ``pytorch-lightning`` (a copy of ``lightning`` under another name) and this
package are left out, and so are vendored copies of other projects (``_vendor/`` and the like).
Every file is read as strict UTF-8 (files that are not, or hold NUL bytes, are
skipped) and cut into documents as the default corpus cuts its sources
(:mod:`selection_callbacks.data.corpus_docs`), at most ``DOCS_PER_FILE`` per file; each domain is
filled round robin over projects in a seeded file order.

The pool depends on the installed distributions: ``card.json`` lists each one with its version and
which split it fed, and a build is up to date only for the same list. Nothing is downloaded.

Usage: ``selection-callbacks packages --out data/packages [--seed 0] [--force]``.
"""

from __future__ import annotations

import functools
import importlib.metadata as metadata
import platform
import re
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from jsonargparse import ActionSubCommands, ArgumentParser, Namespace

from selection_callbacks.data.corpus_docs import (
    HELDOUT_SPLITS,
    SPLITS,
    Doc,
    build_or_keep,
    dedupe_across,
    docs_from,
    domain_stats,
    domain_table,
    files_match,
    fill,
    read_card,
    rng_for,
    round_robin,
    write_corpus,
)

FORMAT_VERSION = 1
DOMAINS = ("python", "stubs", "native", "docs", "licenses", "manifests", "data")
TARGET_DOMAIN = "python"
POOL_CAPS = {
    "python": 800_000,
    "stubs": 800_000,
    "native": 1_500_000,
    "docs": 1_500_000,
    "licenses": 600_000,
    "manifests": 900_000,
    "data": 1_000_000,
}
HELDOUT_BYTES = 250_000
"""Bytes of Python source in each of target and val."""
HELDOUT_BYTES_PER_PROJECT = 50_000
"""At most this much of one project in a held-out split, so each holds several projects."""
DOCS_PER_FILE = 4
MAX_FILE_BYTES = 1_000_000
LEFT_OUT = ("selection-callbacks", "pytorch-lightning")

NATIVE_SUFFIXES = (".h", ".hh", ".hpp", ".hxx", ".c", ".cc", ".cpp", ".cxx", ".cu", ".cuh", ".pyx", ".pxd", ".pxi")
DOCS_SUFFIXES = (".md", ".rst", ".markdown")
DATA_SUFFIXES = (".json", ".csv", ".tsv", ".yaml", ".yml", ".toml", ".cfg", ".ini", ".afm", ".txt", ".xml", ".svg")
MANIFEST_NAMES = ("RECORD", "SOURCES.txt", "entry_points.txt", "top_level.txt", "WHEEL", "direct_url.json")
VENDORED = frozenset(("__pycache__", "_vendor", "vendor", "_vendored", "vendored", "third_party", "extern", "_distutils"))
"""Folders left out: caches, and copies of other projects' code (which could carry a held-out project into the pool)."""
LICENSE_NAME = re.compile(r"^(LICEN[CS]E|COPYING|NOTICE|AUTHORS|COPYRIGHT)", re.IGNORECASE)
DOCS_NAME = re.compile(r"^(README|CHANGES|CHANGELOG|HISTORY|CONTRIBUTING)", re.IGNORECASE)


def domain_of(path: str) -> str | None:
    """The domain a file of an installed distribution belongs to by its path; None: not text we use."""
    parts = path.split("/")
    name = parts[-1]
    if ".." in parts or not VENDORED.isdisjoint(parts[:-1]):
        return None
    in_metadata = any(p.endswith((".dist-info", ".egg-info")) for p in parts[:-1])
    if LICENSE_NAME.match(name) or (in_metadata and "licenses" in parts[:-1]):
        return "licenses"
    if in_metadata:
        return "manifests" if name in MANIFEST_NAMES else "docs" if name in ("METADATA", "PKG-INFO") else None
    suffix = name[name.rfind("."):].lower() if "." in name else ""
    if suffix == ".py":
        return "python"
    if suffix == ".pyi":
        return "stubs"
    if suffix in NATIVE_SUFFIXES:
        return "native"
    if suffix in DOCS_SUFFIXES or DOCS_NAME.match(name):
        return "docs"
    if suffix in DATA_SUFFIXES:
        return "data"
    return None


@functools.cache
def installed_projects() -> tuple[metadata.Distribution, ...]:
    """The distributions installed beside the running interpreter, one per name, sorted by name, minus
    ``LEFT_OUT`` (read once per process)."""
    paths = sorted({sysconfig.get_paths()[k] for k in ("purelib", "platlib")})
    found: dict[str, metadata.Distribution] = {}
    for dist in metadata.distributions(path=paths):
        name = project_name(dist)
        if name and name not in LEFT_OUT:
            found.setdefault(name, dist)
    return tuple(found[name] for name in sorted(found))


def installed_versions() -> dict[str, str]:
    """``{project: version}`` of :func:`installed_projects`."""
    return {project_name(d): d.version for d in installed_projects()}


def project_name(dist: metadata.Distribution) -> str:
    """The distribution's normalised name (PEP 503: lower case, runs of ``-_.`` as ``-``)."""
    return re.sub(r"[-_.]+", "-", (dist.metadata["Name"] or "")).lower()


def read_text(path: Path) -> str | None:
    """The file as strict UTF-8, or None (missing, too large, not UTF-8, or holding NUL bytes)."""
    try:
        if path.stat().st_size > MAX_FILE_BYTES:
            return None
        text = path.read_bytes().decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    return None if "\x00" in text else text


@functools.cache
def project_files(dist: metadata.Distribution) -> dict[str, tuple[str, ...]]:
    """The distribution's recorded files by domain, sorted (paths relative to its install root)."""
    by_domain: dict[str, list[str]] = {}
    for entry in dist.files or []:
        domain = domain_of(entry.as_posix())
        if domain is not None:
            by_domain.setdefault(domain, []).append(entry.as_posix())
    return {d: tuple(sorted(set(paths))) for d, paths in by_domain.items()}


def project_docs(dist: metadata.Distribution, domain: str, seed: int) -> Iterator[Doc]:
    """Documents of one domain of one project, file by file in a seeded order (files are read lazily)."""
    name = project_name(dist)
    paths = list(project_files(dist).get(domain, ()))
    rng_for(seed, f"files/{name}/{domain}").shuffle(paths)
    for rel in paths:
        text = read_text(Path(dist.locate_file(rel)))
        if text:
            yield from docs_from(domain, f"{name}/{rel}", text, group=f"{name}/{rel}")[:DOCS_PER_FILE]


def hold_out(projects: list[metadata.Distribution], seed: int) -> dict[str, list[Doc]]:
    """Target and val: Python source of projects drawn from ``seed``, filled in turn to
    ``HELDOUT_BYTES`` each, at most ``HELDOUT_BYTES_PER_PROJECT`` of one project; ``held_out`` names
    every project that fed either split."""
    order = [d for d in projects if project_files(d).get(TARGET_DOMAIN)]
    rng_for(seed, "held-out projects").shuffle(order)
    splits: dict[str, list[Doc]] = {s: [] for s in HELDOUT_SPLITS}
    filled = dict.fromkeys(HELDOUT_SPLITS, 0)
    for dist in order:
        split = min(HELDOUT_SPLITS, key=lambda s: filled[s])
        if filled[split] >= HELDOUT_BYTES:
            break
        docs = fill(project_docs(dist, TARGET_DOMAIN, seed), min(HELDOUT_BYTES_PER_PROJECT, HELDOUT_BYTES - filled[split]))
        splits[split] += docs
        filled[split] += sum(d.nbytes for d in docs)
    return splits


def build_splits(seed: int = 0) -> tuple[dict[str, list[Doc]], dict[str, dict[str, str]]]:
    """All documents by split (exact duplicates removed, held-out splits first) and, per split, the
    projects that fed it with their versions."""
    projects = installed_projects()
    splits = hold_out(projects, seed)
    held = {d.group.split("/", 1)[0] for s in HELDOUT_SPLITS for d in splits[s]}
    pool_projects = [d for d in projects if project_name(d) not in held]
    pool = []
    for domain in DOMAINS:
        streams = [project_docs(d, domain, seed) for d in pool_projects]
        rng_for(seed, f"project order/{domain}").shuffle(streams)
        pool += fill(round_robin(streams), POOL_CAPS[domain])
    splits = dedupe_across({"pool": pool, **splits})
    versions = installed_versions()
    fed = {s: {p: versions[p] for p in sorted({d.group.split("/", 1)[0] for d in splits[s]})} for s in SPLITS}
    return splits, fed


def _card(splits: dict[str, list[Doc]], fed: dict[str, dict[str, str]], seed: int) -> dict:
    return {
        "format_version": FORMAT_VERSION,
        "kind": "packages",
        "python_version": platform.python_version(),
        "seed": seed,
        "target_domain": TARGET_DOMAIN,
        "bytes_are": "UTF-8 bytes of the text fields",
        "installed": installed_versions(),
        "projects": fed,
        "splits": {split: domain_stats(docs, DOMAINS) for split, docs in splits.items()},
    }


def is_up_to_date(out_dir: str | Path, seed: int) -> bool:
    """True when out_dir holds a complete build for this seed, interpreter and set of installed projects."""
    out, card = Path(out_dir), read_card(out_dir)
    if card is None or card.get("seed") != seed or card.get("format_version") != FORMAT_VERSION:
        return False
    if card.get("python_version") != platform.python_version():
        return False
    if card.get("installed") != installed_versions():
        return False
    return files_match(out, card)


def build_package_corpus(out_dir: str | Path, seed: int = 0, force: bool = False) -> dict:
    """Write pool/target/val jsonl files and card.json to out_dir; return the card (an up-to-date build is
    kept unless ``force``)."""
    out = Path(out_dir)
    if not force and is_up_to_date(out, seed):
        return read_card(out)
    splits, fed = build_splits(seed)
    return write_corpus(out, splits, _card(splits, fed, seed))


def render_card_markdown(card: dict) -> str:
    """Markdown table of documents and MB (10^6 UTF-8 bytes) per domain and split, then the projects per split."""
    lines = [domain_table(card, DOMAINS), ""]
    for split in SPLITS:
        projects = card["projects"][split]
        lines.append(f"- {split}: {len(projects)} projects: " + ", ".join(f"{p} {v}" for p, v in projects.items()))
    return "\n".join(lines)


def build_parser(parent: ActionSubCommands | None = None, name: str = "packages") -> ArgumentParser:
    """The ``packages`` command, standalone or as subcommand ``name`` of ``parent``."""
    description = __doc__.splitlines()[0]
    parser = ArgumentParser(prog="python -m selection_callbacks.data.package_corpus", description=description)
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--seed", type=int, default=0, help="seed for the held-out projects and the file order")
    parser.add_argument("--force", action="store_true", help="rebuild even if up to date")
    if parent is not None:
        parent.add_subcommand(name, parser, help=description)
    return parser


def run(args: Namespace) -> int:
    """Build (or keep) the corpus and print its card; 0."""
    out = Path(args.out)
    keep = not args.force and is_up_to_date(out, args.seed)
    return build_or_keep(out, keep, lambda: build_package_corpus(out, args.seed, force=True), "package corpus", args.seed, render_card_markdown)


def main(argv: list[str] | None = None) -> int:
    """``python -m selection_callbacks.data.package_corpus``: parse ``argv`` and build; the exit status."""
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
