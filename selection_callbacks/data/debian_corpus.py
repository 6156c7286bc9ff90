"""Build a third, large visible corpus offline from the text that ships inside installed Debian packages.

The *target* (and its validation split) is technical prose of a few held-out source packages; the
*pool* mixes seven domains drawn from the files of every *other* installed package, the target's
domain a minority in it:

- ``prose``: technical documentation in text formats: reStructuredText (Sphinx ``_sources`` too),
  Markdown, AsciiDoc, POD, Info manuals and the plain-text files under ``/usr/share/doc`` (the
  target's domain, from other source packages);
- ``code``: source code in many languages (C and C++ headers, Go, Rust, Perl, Python, Ruby,
  JavaScript, Emacs Lisp, Tcl, Lua, R, shell, ...);
- ``manpages``: English manual pages, roff source;
- ``markup``: HTML, XML, SVG and CSS (generated documentation sites, schemas, icons);
- ``licenses``: Debian ``copyright`` files, licence and notice texts, many near-copies of each other;
- ``changelogs``: Debian and upstream changelogs and NEWS files, largely boilerplate;
- ``data``: generated or tabular text: locale definitions, character maps, Unicode and hardware
  tables, keymaps, certificates, translation catalogues, JSON, CSV, YAML, minified JavaScript.

Source packages are held out whole: every binary package built from a held-out source feeds nothing to
the pool, so a selector must find *prose* rather than a project it has seen. Which sources are held out
is drawn from ``seed``. Python's own documentation (``python3-doc``, the default pool's prose) is left
out, and so are dictionaries, word lists, fortunes and spelling or hyphenation tables. Files are read
as strict UTF-8 (``.gz`` files decompressed; files that are not UTF-8, or hold NUL bytes, are skipped)
and cut into documents as the other corpora cut theirs (:mod:`selection_callbacks.data.corpus_docs`),
at most ``DOCS_PER_FILE`` per file; each domain is filled round robin over source packages, each
package's files in a seeded order.

The pool depends on the installed packages: ``card.json`` lists every installed package with its
version, and the source packages (with their versions) that fed each split; a build is up to date only
for the same list. ``configs/corpus/debian-packages.txt`` names the packages installed for the build
the repository measures (``make data-debian`` installs them with apt, then builds). Nothing else is
downloaded.

Usage: ``selection-callbacks debian --out data/debian [--seed 0] [--root /] [--force]``.
"""

from __future__ import annotations

import gzip
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from jsonargparse import ActionSubCommands, ArgumentParser, Namespace

from selection_callbacks.data.corpus_docs import (
    HELDOUT_SPLITS,
    MAX_DOC_BYTES,
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
DOMAINS = ("prose", "code", "manpages", "markup", "licenses", "changelogs", "data")
TARGET_DOMAIN = "prose"
POOL_CAPS = {
    "prose": 30_000_000,
    "code": 45_000_000,
    "manpages": 15_000_000,
    "markup": 25_000_000,
    "licenses": 10_000_000,
    "changelogs": 10_000_000,
    "data": 20_000_000,
}
"""UTF-8 bytes of each domain in the pool."""
HELDOUT_BYTES = {"target": 2_500_000, "val": 1_250_000}
"""Bytes of prose in each held-out split."""
HELDOUT_BYTES_PER_SOURCE = 400_000
"""At most this much of one source package in a held-out split, so each holds several."""


@dataclass(frozen=True)
class Sizes:
    """How much each split takes: the pool's bytes per domain, each held-out split's bytes, and the most one
    source package gives a held-out split. The defaults build the measured corpus; tests build small ones."""

    pool: dict[str, int] = field(default_factory=lambda: dict(POOL_CAPS))
    heldout: dict[str, int] = field(default_factory=lambda: dict(HELDOUT_BYTES))
    per_source: int = HELDOUT_BYTES_PER_SOURCE


DOCS_PER_FILE = 8
READ_BYTES = 2 * DOCS_PER_FILE * MAX_DOC_BYTES
"""A file is read up to this many bytes (whole lines): more than its ``DOCS_PER_FILE`` documents need."""
MAX_FILE_BYTES = 50_000_000
"""Larger files (compressed size) are skipped."""

LEFT_OUT_PACKAGES = re.compile(r"^(python3(\.\d+)?-doc|fortunes?(-.*)?|w[a-z]+-?(english|american|british)(-.*)?)$")
"""Python's own documentation (the default pool's prose), fortune files and word lists."""
LEFT_OUT_DIRS = ("/usr/share/dict/", "/usr/share/games/", "/usr/share/hunspell/", "/usr/share/myspell/",
                 "/usr/share/hyphen/", "/usr/share/aspell/", "/usr/share/doc/python3-doc/")
"""Dictionaries, fortunes, spelling and hyphenation tables, and Python's documentation tree."""

PROSE_SUFFIXES = (".rst", ".md", ".markdown", ".adoc", ".asciidoc", ".pod", ".info", ".texi", ".texinfo")
DOC_TEXT_SUFFIXES = (".txt", ".text")
"""Suffixes that are prose only under ``/usr/share/doc`` (elsewhere ``.txt`` is data)."""
DOC_NAME = re.compile(r"^(README|FAQ|TODO|INSTALL|USAGE|HACKING|THANKS|BUGS|NOTES|DESIGN|TUTORIAL|MANUAL|GUIDE)",
                      re.IGNORECASE)
"""Files without a suffix that are prose under ``/usr/share/doc`` (others there, e.g. test scripts, are skipped)."""
CODE_SUFFIXES = (
    ".c", ".h", ".cc", ".cpp", ".cxx", ".hh", ".hpp", ".hxx", ".ipp", ".inl", ".tcc", ".rs", ".go", ".java",
    ".js", ".mjs", ".cjs", ".ts", ".py", ".pl", ".pm", ".t", ".rb", ".lua", ".el", ".scm", ".lisp", ".cl",
    ".tcl", ".sh", ".bash", ".zsh", ".php", ".r", ".jl", ".hs", ".ml", ".mli", ".s", ".cmake", ".m4",
    ".awk", ".vim", ".erl", ".ex", ".exs", ".clj", ".kt", ".scala", ".cs", ".f90", ".f", ".proto", ".sql",
    ".swift", ".coffee", ".vala", ".d", ".nim", ".pyx", ".pxd", ".y", ".l", ".am", ".mk",
)
MARKUP_SUFFIXES = (".html", ".htm", ".xhtml", ".xml", ".svg", ".xsl", ".xslt", ".xsd", ".dtd", ".ent", ".sgml",
                   ".docbook", ".css", ".rng", ".tex", ".sty")
DATA_SUFFIXES = (".json", ".csv", ".tsv", ".yaml", ".yml", ".toml", ".ini", ".cfg", ".conf", ".po", ".pot",
                 ".dat", ".map", ".ids", ".kmap", ".txt", ".crt", ".pem", ".tab", ".zi", ".properties", ".sfd")
DATA_DIRS = ("/usr/share/i18n/", "/usr/share/keymaps/", "/usr/share/consolefonts/", "/usr/share/consoletrans/",
             "/usr/share/unicode/", "/usr/share/hwdata/", "/usr/share/misc/", "/usr/share/mime/",
             "/usr/share/publicsuffix/", "/usr/share/zoneinfo/", "/usr/share/ca-certificates/", "/usr/share/iso-codes/",
             "/usr/share/xml/iso-codes/")
"""Folders of tables and generated files: everything in them with a text suffix (or none) is data."""
LICENSE_NAME = re.compile(r"^(copyright|LICEN[CS]E|COPYING|NOTICE|AUTHORS|COPYRIGHT|UNLICENSE)", re.IGNORECASE)
CHANGELOG_NAME = re.compile(r"^(changelog|changes|news|history|release[-_ ]?notes)([._-].*)?$", re.IGNORECASE)
INFO_PART = re.compile(r"\.info-[0-9]+$")
"""A part of a split Info manual (``gettext.info-2``)."""
MANPAGE_DIR = re.compile(r"^/usr/share/man/man[0-9n][a-z]*/")


@dataclass(frozen=True)
class Package:
    """One installed binary package: its name, architecture, version and the source package it came from."""

    name: str
    arch: str
    version: str
    source: str
    source_version: str


def suffix_of(name: str) -> str:
    """The file's text suffix, lower case, after a ``.gz`` is taken off (``README.md.gz`` → ``.md``)."""
    name = name.removesuffix(".gz").lower()
    if name.endswith(".min.js"):
        return ".min.js"
    return ".info" if INFO_PART.search(name) else PurePosixPath(name).suffix


def domain_of(path: str) -> str | None:
    """The domain of an installed file by its absolute path; None: not text we use."""
    if path.startswith(LEFT_OUT_DIRS) or path.endswith((".bz2", ".xz", ".zst", ".zip")):
        return None
    name, suffix = PurePosixPath(path).name, suffix_of(path)
    if path.startswith("/usr/share/common-licenses/") or LICENSE_NAME.match(name):
        return "licenses"
    if MANPAGE_DIR.match(path):
        return "manpages"
    in_docs = path.startswith(("/usr/share/doc/", "/usr/share/info/")) or "/_sources/" in path
    if in_docs and CHANGELOG_NAME.match(name):
        return "changelogs"
    if suffix in PROSE_SUFFIXES or (in_docs and (suffix in DOC_TEXT_SUFFIXES or DOC_NAME.match(name))):
        return "prose"
    if suffix == ".min.js" or path.startswith(DATA_DIRS):
        return "data"
    if suffix in CODE_SUFFIXES:
        return "code"
    if suffix in MARKUP_SUFFIXES:
        return "markup"
    if suffix in DATA_SUFFIXES:
        return "data"
    return None


def parse_status(text: str) -> list[Package]:
    """The installed packages of a dpkg ``status`` file (``Status: install ok installed``), sorted by name and
    architecture; a package's source defaults to its own name and version."""
    packages = []
    for paragraph in text.split("\n\n"):
        fields: dict[str, str] = {}
        for line in paragraph.splitlines():
            if line[:1] not in (" ", "\t") and ":" in line:
                key, _, value = line.partition(":")
                fields[key] = value.strip()
        if fields.get("Status", "").split()[-1:] != ["installed"] or "Package" not in fields:
            continue
        source, _, source_version = fields.get("Source", fields["Package"]).partition(" ")
        version = fields.get("Version", "")
        packages.append(Package(fields["Package"], fields.get("Architecture", ""), version, source,
                                source_version.strip("()") or version))
    return sorted(packages, key=lambda p: (p.name, p.arch))


def installed_packages(root: str | Path) -> tuple[Package, ...]:
    """The packages installed under ``root`` (its ``var/lib/dpkg/status``), minus ``LEFT_OUT_PACKAGES``."""
    status = Path(root) / "var/lib/dpkg/status"
    if not status.is_file():
        raise FileNotFoundError(f"{status} does not exist: --root must be a Debian system's root folder (dpkg's "
                                "database under var/lib/dpkg), e.g. / or a debootstrap chroot")
    found = parse_status(status.read_text(encoding="utf-8", errors="replace"))
    return tuple(p for p in found if not LEFT_OUT_PACKAGES.match(p.name))


def installed_versions(packages: tuple[Package, ...]) -> dict[str, str]:
    """``{package[:arch]: version}``: the architecture is named only where the name alone is ambiguous."""
    names = [p.name for p in packages]
    return {(p.name if names.count(p.name) == 1 else f"{p.name}:{p.arch}"): p.version for p in packages}


def package_files(root: str | Path, package: Package) -> dict[str, tuple[str, ...]]:
    """The package's regular files by domain, sorted (absolute paths as dpkg lists them in ``<name>[:arch].list``)."""
    info = Path(root) / "var/lib/dpkg/info"
    listing = next((f for f in (info / f"{package.name}:{package.arch}.list", info / f"{package.name}.list")
                    if f.is_file()), None)
    by_domain: dict[str, list[str]] = {}
    for line in listing.read_text(encoding="utf-8", errors="replace").splitlines() if listing else ():
        domain = domain_of(line)
        if domain is not None and _regular_file(Path(root), line):
            by_domain.setdefault(domain, []).append(line)
    return {d: tuple(sorted(set(paths))) for d, paths in by_domain.items()}


def _regular_file(root: Path, path: str) -> bool:
    full = root / path.lstrip("/")
    return full.is_file() and not full.is_symlink()


def read_text(root: str | Path, path: str) -> str | None:
    """The file's first ``READ_BYTES`` (whole lines; ``.gz`` decompressed) as strict UTF-8, or None (missing,
    larger than ``MAX_FILE_BYTES``, not UTF-8, or holding NUL bytes)."""
    full = Path(root) / path.lstrip("/")
    try:
        if full.stat().st_size > MAX_FILE_BYTES:
            return None
        opener = gzip.open if path.endswith(".gz") else open
        with opener(full, "rb") as f:
            raw = f.read(READ_BYTES + 1)
        if len(raw) > READ_BYTES:
            raw = raw[: raw.rfind(b"\n", 0, READ_BYTES) + 1]
        text = raw.decode("utf-8")
    except (OSError, EOFError, UnicodeDecodeError):
        return None
    return None if "\x00" in text else text


class Installed:
    """The installed packages under ``root`` grouped by source package, with their files by domain (listed lazily,
    once per source)."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.packages = installed_packages(root)
        self.sources: dict[str, list[Package]] = {}
        for p in self.packages:
            self.sources.setdefault(p.source, []).append(p)
        self._files: dict[str, dict[str, tuple[str, ...]]] = {}

    def files(self, source: str) -> dict[str, tuple[str, ...]]:
        """The source's files by domain over all its binary packages."""
        if source not in self._files:
            merged: dict[str, set[str]] = {}
            for package in self.sources[source]:
                for domain, paths in package_files(self.root, package).items():
                    merged.setdefault(domain, set()).update(paths)
            self._files[source] = {d: tuple(sorted(paths)) for d, paths in merged.items()}
        return self._files[source]

    def docs(self, source: str, domain: str, seed: int) -> Iterator[Doc]:
        """Documents of one domain of one source package, file by file in a seeded order (read lazily)."""
        paths = list(self.files(source).get(domain, ()))
        rng_for(seed, f"files/{source}/{domain}").shuffle(paths)
        for path in paths:
            text = read_text(self.root, path)
            if text:
                yield from docs_from(domain, f"{source}{path}", text, group=source)[:DOCS_PER_FILE]

    def source_versions(self, sources: set[str]) -> dict[str, str]:
        """``{source: version}``, sorted by name (a source's version as its first binary package names it)."""
        return {s: self.sources[s][0].source_version for s in sorted(sources)}


def hold_out(installed: Installed, seed: int, sizes: Sizes) -> dict[str, list[Doc]]:
    """Target and val: prose of source packages drawn from ``seed``, each split filled to its
    ``sizes.heldout`` bytes (the emptier split, by share, takes the next source), at most
    ``sizes.per_source`` of one source."""
    order = [s for s in sorted(installed.sources) if installed.files(s).get(TARGET_DOMAIN)]
    rng_for(seed, "held-out sources").shuffle(order)
    splits: dict[str, list[Doc]] = {s: [] for s in HELDOUT_SPLITS}
    filled = dict.fromkeys(HELDOUT_SPLITS, 0)
    for source in order:
        split = min(HELDOUT_SPLITS, key=lambda s: filled[s] / sizes.heldout[s])
        room = sizes.heldout[split] - filled[split]
        if room <= 0:
            break
        docs = fill(installed.docs(source, TARGET_DOMAIN, seed), min(sizes.per_source, room))
        splits[split] += docs
        filled[split] += sum(d.nbytes for d in docs)
    return splits


def build_splits(root: str | Path = "/", seed: int = 0,
                 sizes: Sizes = Sizes()) -> tuple[dict[str, list[Doc]], Installed]:
    """All documents by split (exact duplicates removed, held-out splits first) and the installed packages read."""
    installed = Installed(root)
    splits = hold_out(installed, seed, sizes)
    held = {d.group for s in HELDOUT_SPLITS for d in splits[s]}
    pool_sources = [s for s in sorted(installed.sources) if s not in held]
    pool: list[Doc] = []
    for domain in DOMAINS:
        streams = [installed.docs(s, domain, seed) for s in pool_sources if installed.files(s).get(domain)]
        rng_for(seed, f"source order/{domain}").shuffle(streams)
        pool += fill(round_robin(streams), sizes.pool[domain])
    return dedupe_across({"pool": pool, **splits}), installed


def debian_version(root: str | Path) -> str:
    """``etc/debian_version`` under ``root``, or ``"unknown"``."""
    try:
        return (Path(root) / "etc/debian_version").read_text(encoding="utf-8").strip()
    except OSError:
        return "unknown"


def build_card(splits: dict[str, list[Doc]], installed: Installed, seed: int, sizes: Sizes) -> dict:
    """The card: what was installed, which source packages fed each split, documents and bytes per domain."""
    return {
        "format_version": FORMAT_VERSION,
        "kind": "debian",
        "debian_version": debian_version(installed.root),
        "seed": seed,
        "target_domain": TARGET_DOMAIN,
        "bytes_are": "UTF-8 bytes of the text fields",
        "sizes": {"pool": sizes.pool, "heldout": sizes.heldout, "per_source": sizes.per_source},
        "installed": installed_versions(installed.packages),
        "sources": {split: installed.source_versions({d.group for d in docs}) for split, docs in splits.items()},
        "splits": {split: domain_stats(docs, DOMAINS) for split, docs in splits.items()},
    }


def is_up_to_date(out_dir: str | Path, seed: int, root: str | Path = "/", sizes: Sizes = Sizes()) -> bool:
    """True when ``out_dir`` holds a complete build for this seed, these sizes and the same installed packages."""
    card = read_card(out_dir)
    if card is None or card.get("seed") != seed or card.get("format_version") != FORMAT_VERSION:
        return False
    if card.get("sizes") != {"pool": sizes.pool, "heldout": sizes.heldout, "per_source": sizes.per_source}:
        return False
    return card.get("installed") == installed_versions(installed_packages(root)) and files_match(out_dir, card)


def build_debian_corpus(out_dir: str | Path, seed: int = 0, root: str | Path = "/", force: bool = False,
                        sizes: Sizes = Sizes()) -> dict:
    """Write pool/target/val jsonl files and card.json to ``out_dir``; return the card (an up-to-date build is kept
    unless ``force``)."""
    if not force and is_up_to_date(out_dir, seed, root, sizes):
        return read_card(out_dir)
    splits, installed = build_splits(root, seed, sizes)
    return write_corpus(Path(out_dir), splits, build_card(splits, installed, seed, sizes))


def render_card_markdown(card: dict) -> str:
    """Markdown table of documents and MB (10^6 UTF-8 bytes) per domain and split, then the sources per split."""
    lines = [domain_table(card, DOMAINS), ""]
    for split in SPLITS:
        sources = card["sources"][split]
        shown = ", ".join(f"{s} {v}" for s, v in sources.items()) if split != "pool" else "(card.json lists them)"
        lines.append(f"- {split}: {len(sources)} source packages: {shown}")
    return "\n".join(lines)


def build_parser(parent: ActionSubCommands | None = None, name: str = "debian") -> ArgumentParser:
    """The ``debian`` command, standalone or as subcommand ``name`` of ``parent``."""
    description = __doc__.splitlines()[0]
    parser = ArgumentParser(prog="python -m selection_callbacks.data.debian_corpus", description=description)
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--seed", type=int, default=0, help="seed for the held-out sources and the file order")
    parser.add_argument("--root", default="/", help="the Debian system whose packages are read (e.g. a chroot)")
    parser.add_argument("--force", action="store_true", help="rebuild even if up to date")
    if parent is not None:
        parent.add_subcommand(name, parser, help=description)
    return parser


def run(args: Namespace) -> int:
    """Build (or keep) the corpus and print its card; 0."""
    out = Path(args.out)
    keep = not args.force and is_up_to_date(out, args.seed, args.root)
    return build_or_keep(out, keep, lambda: build_debian_corpus(out, args.seed, args.root, force=True),
                         "Debian corpus", args.seed, render_card_markdown)


def main(argv: list[str] | None = None) -> int:
    """``python -m selection_callbacks.data.debian_corpus``: parse ``argv`` and build; the exit status."""
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
