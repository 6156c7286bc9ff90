"""Build the project's default corpus offline from the Python standard library.

The corpus mixes six domains of deliberately different quality so that a data
selector has something to find. The *target* (and its validation split) is
English technical prose only; the *pool* mixes every domain. All inputs come
from files that every CPython installation ships, so the build is offline and,
for a given installation and seed, byte-for-byte reproducible.

Usage: ``selection-callbacks corpus --out DIR [--seed 0] [--force] [--pool-mb MB]`` (or
``python -m selection_callbacks.data.default_corpus`` with the same arguments). ``--pool-mb``
resamples the pool to that many MB (spans of its documents, see
:mod:`selection_callbacks.data.resampled_pool`): a pool of any size for scale tests, with the same
target and val splits.
"""

from __future__ import annotations

import ast
import keyword
import os
import platform
import random
import re
import string
import sysconfig
import token
import tokenize
import unicodedata
import warnings
from collections.abc import Iterator
from itertools import chain, count
from pathlib import Path

from jsonargparse import ActionSubCommands, ArgumentParser, Namespace

from selection_callbacks.data.corpus_docs import (
    HELDOUT_SPLITS,
    MAX_DOC_BYTES,
    SPLITS,
    Doc,
    build_or_keep,
    chunk,
    dedupe_across,
    docs_from,
    domain_stats,
    domain_table,
    files_match,
    fill,
    nbytes,
    read_card,
    rng_for,
    shuffled,
    write_corpus,
)
from selection_callbacks.data.resampled_pool import resample_pool

FORMAT_VERSION = 1
DOMAINS = ("prose", "code", "multilingual", "data", "noise", "repetitive")
TARGET_DOMAIN = "prose"
POOL_CAPS = {
    "prose": 2_500_000,
    "code": 2_500_000,
    "multilingual": 600_000,
    "data": 800_000,
    "noise": 800_000,
    "repetitive": 800_000,
}
HELDOUT_FRACTION = 0.08
MIN_DOCSTRING_CHARS = 200
SYNTH_BYTES = (1024, 4096)
TABLE_BYTES = (2048, 4096)
CODEC_SHARE = 0.3
SKIP_DIRS = ("__pycache__", "idle_test", "site-packages", "test", "tests")
# prose source (pydoc topics) and codec tables (already in `data`) stay out of `code`
CODE_SKIP_PREFIXES = ("encodings/", "pydoc_data/")

SINGLE_BYTE_CODECS = (
    "cp037", "cp437", "cp737", "cp850", "cp852", "cp855", "cp857", "cp866",
    "cp869", "cp874", "cp1250", "cp1251", "cp1252", "cp1253", "cp1254",
    "cp1255", "cp1256", "cp1257", "cp1258", "iso8859_2", "iso8859_5",
    "iso8859_7", "iso8859_8", "iso8859_15", "koi8_r", "koi8_u", "mac_cyrillic",
    "mac_greek", "mac_roman", "mac_turkish",
)

# (name, code point ranges, word length range, words separated by spaces, sentence end)
SCRIPTS = (
    ("greek", ((0x03B1, 0x03C9),), (2, 9), True, "."),
    ("cyrillic", ((0x0430, 0x044F),), (2, 10), True, "."),
    ("armenian", ((0x0561, 0x0586),), (2, 9), True, "։"),
    ("hebrew", ((0x05D0, 0x05EA),), (2, 7), True, "."),
    ("arabic", ((0x0621, 0x064A),), (2, 8), True, "."),
    ("devanagari", ((0x0905, 0x0939),), (2, 6), True, "।"),
    ("bengali", ((0x0985, 0x09B9),), (2, 6), True, "।"),
    ("tamil", ((0x0B85, 0x0BB9),), (2, 7), True, "."),
    ("thai", ((0x0E01, 0x0E2E),), (2, 6), False, " "),
    ("georgian", ((0x10D0, 0x10F0),), (2, 9), True, "."),
    ("hiragana", ((0x3041, 0x3096),), (1, 4), False, "。"),
    ("katakana", ((0x30A1, 0x30FA),), (2, 5), False, "。"),
    ("hangul", ((0xAC00, 0xD7A3),), (1, 4), True, "."),
    ("han", ((0x4E00, 0x9FFF),), (1, 3), False, "。"),
)
VOCAB_SIZE = 400
NOISE_CHARS = tuple(
    ch for ch in map(chr, chain(range(0x21, 0x250), range(0x370, 0x500)))
    if ch.isprintable() and not ch.isspace() and ch != "\xad"
)


# ---------------------------------------------------------------- sources


def stdlib_dir() -> Path:
    """The standard library directory of the running interpreter."""
    return Path(sysconfig.get_paths()["stdlib"])


def _stdlib_sources(root: Path) -> list[tuple[str, str]]:
    """(relative posix path, source text) of stdlib .py files outside test dirs, sorted."""
    sources = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
        for filename in sorted(f for f in filenames if f.endswith(".py")):
            path = Path(dirpath, filename)
            try:
                with tokenize.open(path) as handle:
                    sources.append((path.relative_to(root).as_posix(), handle.read()))
            except (OSError, SyntaxError, UnicodeDecodeError):
                continue
    return sorted(sources)


def _docstrings(source: str) -> list[str]:
    """Module/class/function docstrings of at least MIN_DOCSTRING_CHARS, in source order."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    nodes = [node for node in ast.walk(tree) if isinstance(node, kinds)]
    nodes.sort(key=lambda node: getattr(node, "lineno", 0))
    docs = (ast.get_docstring(node) for node in nodes)
    return [doc for doc in docs if doc and len(doc) >= MIN_DOCSTRING_CHARS]


def _pydoc_topics() -> dict[str, str]:
    """The pydoc help topics (reference-manual sections), or {} if not installed."""
    try:
        from pydoc_data.topics import topics
    except ImportError:
        return {}
    return topics


# ---------------------------------------------------------------- domains


def _prose_candidates(sources: list[tuple[str, str]]) -> list[Doc]:
    """pydoc topics (one source each) and per-module docstring collections."""
    topics = _pydoc_topics()
    docs = [doc for key in sorted(topics) for doc in docs_from("prose", f"pydoc-topics/{key}", topics[key])]
    for rel, source in sources:
        docs += docs_from("prose", f"docstrings/{rel}", "\n\n".join(_docstrings(source)), group=rel)
    return fill(docs, float("inf"))


def _split_prose(prose: list[Doc], rng: random.Random) -> dict[str, list[Doc]]:
    """Assign whole source groups to target/val (~HELDOUT_FRACTION of bytes each), rest to pool."""
    sizes: dict[str, int] = {}
    for doc in prose:
        sizes[doc.group] = sizes.get(doc.group, 0) + doc.nbytes
    budget = min(sum(sizes.values()), POOL_CAPS["prose"] / (1 - len(HELDOUT_SPLITS) * HELDOUT_FRACTION))
    quota = HELDOUT_FRACTION * budget
    groups = list(sizes)
    rng.shuffle(groups)
    filled = dict.fromkeys(HELDOUT_SPLITS, 0)
    label: dict[str, str] = {}
    for group in groups:
        label[group] = next((s for s in HELDOUT_SPLITS if filled[s] < quota), "pool")
        if label[group] in filled:
            filled[label[group]] += sizes[group]
    split = {s: [d for d in prose if label[d.group] == s] for s in SPLITS}
    split["pool"] = fill(shuffled(split["pool"], rng), POOL_CAPS["prose"])
    return split


def _code(sources: list[tuple[str, str]], held_out: frozenset[str], rng: random.Random) -> list[Doc]:
    """Raw stdlib source chunks, excluding modules whose docstrings are held out."""
    docs = [
        doc
        for rel, source in sources
        if rel not in held_out and not rel.startswith(CODE_SKIP_PREFIXES)
        for doc in docs_from("code", rel, source)
    ]
    return fill(shuffled(docs, rng), POOL_CAPS["code"])


def _cjk_texts(root: Path) -> list[Doc]:
    """Lib/test/cjkencodings sample texts, decoded with the codec named by the file."""
    folder = root / "test" / "cjkencodings"
    docs: list[Doc] = []
    for path in sorted(folder.glob("*.txt")) if folder.is_dir() else []:
        codec = "utf-8" if path.stem.endswith("-utf8") else path.stem
        try:
            text = path.read_bytes().decode(codec)
        except (LookupError, UnicodeDecodeError):
            continue
        docs += docs_from("multilingual", f"cjkencodings/{path.name}", text)
    return docs


def _letters(ranges: tuple[tuple[int, int], ...]) -> list[str]:
    """Letters (Unicode category L*) in the given code point ranges."""
    return [chr(c) for lo, hi in ranges for c in range(lo, hi + 1) if unicodedata.category(chr(c)).startswith("L")]


def _script_docs(script: tuple, rng: random.Random) -> Iterator[Doc]:
    """Endless word-like text in one script: a Zipf-distributed vocabulary of pseudo-words."""
    name, ranges, (short, long), spaced, stop = script
    letters = _letters(ranges)
    vocab = ["".join(rng.choices(letters, k=rng.randint(short, long))) for _ in range(VOCAB_SIZE)]
    weights = [1 / rank for rank in range(1, VOCAB_SIZE + 1)]
    joiner = " " if spaced else ""
    for i in count():
        target, paragraphs = rng.randint(*SYNTH_BYTES), [""]
        while nbytes("\n\n".join(paragraphs)) < target:
            words = rng.choices(vocab, weights=weights, k=rng.randint(4, 14))
            sentence = words[0][:1].upper() + joiner.join(words)[1:] + stop
            paragraphs[-1] = f"{paragraphs[-1]} {sentence}".strip() if spaced else paragraphs[-1] + sentence
            if rng.random() < 0.2:
                paragraphs.append("")
        yield from docs_from("multilingual", f"synthetic/{name}/{i}", "\n\n".join(paragraphs))


def _multilingual(root: Path, rng: random.Random) -> list[Doc]:
    """Real CJK sample texts, then synthetic non-Latin-script text, round robin over scripts."""
    synthetic = chain.from_iterable(zip(*(_script_docs(script, rng) for script in SCRIPTS)))
    return fill(chain(_cjk_texts(root), synthetic), POOL_CAPS["multilingual"])


def _table_docs(name: str, header: str, rows: list[str], rng: random.Random) -> list[Doc]:
    """Group table rows into documents of TABLE_BYTES, each starting with the header."""
    docs, start = [], 0
    while start < len(rows):
        target, end, size = rng.randint(*TABLE_BYTES), start, nbytes(header)
        while end < len(rows) and size < target:
            size += nbytes(rows[end]) + 1
            end += 1
        docs += docs_from("data", f"{name}/{start}", "\n".join([header, *rows[start:end]]))
        start = end
    return docs


def _token_tables(rng: random.Random) -> list[Doc]:
    """Python keyword and token tables."""
    kinds = [f"{kw}\thard" for kw in keyword.kwlist] + [f"{kw}\tsoft" for kw in keyword.softkwlist]
    numbers = [f"{num}\t{name}" for num, name in sorted(token.tok_name.items())]
    exact = [f"{op}\t{token.tok_name[num]}" for op, num in sorted(token.EXACT_TOKEN_TYPES.items())]
    return (
        _table_docs("keywords", "keyword\tkind", kinds, rng)
        + _table_docs("token-numbers", "number\tname", numbers, rng)
        + _table_docs("token-operators", "operator\tname", exact, rng)
    )


def _codec_rows(codec: str) -> list[str]:
    """CSV rows mapping each decodable byte of a single-byte codec to its character."""
    rows = []
    for byte in range(256):
        try:
            char = bytes([byte]).decode(codec)
        except UnicodeDecodeError:
            continue
        name = unicodedata.name(char, "<control>")
        rows.append(f"0x{byte:02X},U+{ord(char):04X},{name},{unicodedata.category(char)}")
    return rows


def _codec_tables(rng: random.Random) -> list[Doc]:
    """Byte-to-character tables of the single-byte codecs this interpreter knows."""
    docs: list[Doc] = []
    for codec in SINGLE_BYTE_CODECS:
        try:
            rows = _codec_rows(codec)
        except LookupError:
            continue
        docs += _table_docs(f"codec/{codec}", "byte,code_point,name,category", rows, rng)
    return docs


def _unicode_tables(rng: random.Random) -> list[Doc]:
    """Named code points (skipping algorithmically named ideographs/syllables) as TSV rows."""
    rows = []
    for cp in range(0x110000):
        name = unicodedata.name(chr(cp), "")
        if name and not name.endswith(f"-{cp:04X}") and not name.startswith("HANGUL SYLLABLE"):
            rows.append(f"U+{cp:04X}\t{name}\t{unicodedata.category(chr(cp))}")
    return _table_docs("unicode", "code_point\tname\tcategory", rows, rng)


def _data(rng: random.Random) -> list[Doc]:
    """Keyword/token tables, a share of codec tables, then Unicode character tables."""
    cap = POOL_CAPS["data"]
    codecs = fill(shuffled(_codec_tables(rng), rng), CODEC_SHARE * cap)
    return fill(chain(_token_tables(rng), codecs, shuffled(_unicode_tables(rng), rng)), cap)


def _corrupt(text: str, rng: random.Random) -> str:
    """Replace a random 30-70% of the characters with random printable characters."""
    rate = rng.uniform(0.3, 0.7)
    return "".join(rng.choice(NOISE_CHARS) if rng.random() < rate else ch for ch in text)


def _gibberish(rng: random.Random) -> str:
    """Random printable characters with random spaces, 1-4 KB."""
    chars = rng.choices(NOISE_CHARS, k=rng.randint(*SYNTH_BYTES) // 2)
    return "".join(" " if rng.random() < 0.15 else ch for ch in chars)


def _noise(pool_prose: list[Doc], rng: random.Random) -> list[Doc]:
    """Half corrupted pool prose, half random printable gibberish."""
    cap = POOL_CAPS["noise"]
    pieces = (chunk(doc.text, MAX_DOC_BYTES // 2)[0] for doc in shuffled(pool_prose, rng))
    corrupted = fill(
        (d for i, text in enumerate(pieces) for d in docs_from("noise", f"corrupted/{i}", _corrupt(text, rng))),
        cap / 2,
    )
    random_docs = (d for i in count() for d in docs_from("noise", f"random/{i}", _gibberish(rng)))
    return corrupted + fill(random_docs, cap - sum(d.nbytes for d in corrupted))


def _phrases(pool_prose: list[Doc], code: list[Doc]) -> dict[str, tuple[list[str], str]]:
    """Phrase inventories for repetition, with the separator used between repeats."""
    sentences = [" ".join(s.split()) for doc in pool_prose for s in re.split(r"(?<=[.!?])\s+", doc.text)]
    lines = [line.strip() for doc in code for line in doc.text.splitlines()]
    return {
        "sentence": ([s for s in sentences if 20 <= len(s) <= 160], " "),
        "line": ([line for line in lines if 10 <= len(line) <= 100], "\n"),
    }


def _repetitive(pool_prose: list[Doc], code: list[Doc], rng: random.Random) -> list[Doc]:
    """A sentence, code line or short token repeated to fill 1-4 KB."""
    inventories = _phrases(pool_prose, code)

    def make(i: int) -> list[Doc]:
        kind = rng.choice(("sentence", "line", "token"))
        if kind == "token" or not inventories[kind][0]:
            kind = "token"
            phrase = "".join(rng.choices(string.ascii_lowercase + "=-*#.", k=rng.randint(1, 4)))
            sep = rng.choice(("", " "))
        else:
            phrases, sep = inventories[kind]
            phrase = rng.choice(phrases)
        repeats = max(2, rng.randint(*SYNTH_BYTES) // (nbytes(phrase) + len(sep)))
        return docs_from("repetitive", f"{kind}/{i}", sep.join([phrase] * repeats))

    return fill((d for i in count() for d in make(i)), POOL_CAPS["repetitive"])


# ---------------------------------------------------------------- assembly


def build_splits(seed: int = 0) -> dict[str, list[Doc]]:
    """All documents of the default corpus, by split; exact-duplicate texts removed."""
    root = stdlib_dir()
    sources = _stdlib_sources(root)
    splits = _split_prose(_prose_candidates(sources), rng_for(seed, "split"))
    held_out = frozenset(d.group for s in HELDOUT_SPLITS for d in splits[s])
    prose = splits["pool"]
    code = _code(sources, held_out, rng_for(seed, "code"))
    splits["pool"] = [
        *prose,
        *code,
        *_multilingual(root, rng_for(seed, "multilingual")),
        *_data(rng_for(seed, "data")),
        *_noise(prose, rng_for(seed, "noise")),
        *_repetitive(prose, code, rng_for(seed, "repetitive")),
    ]
    return dedupe_across(splits)


def _card(splits: dict[str, list[Doc]], seed: int, pool_mb: float | None) -> dict:
    return {
        "format_version": FORMAT_VERSION,
        "pool_mb": pool_mb,
        "python_implementation": platform.python_implementation(),
        "python_version": platform.python_version(),
        "unicode_version": unicodedata.unidata_version,
        "seed": seed,
        "target_domain": TARGET_DOMAIN,
        "bytes_are": "UTF-8 bytes of the text fields",
        "splits": {split: domain_stats(docs, DOMAINS) for split, docs in splits.items()},
    }


def is_up_to_date(out_dir: str | Path, seed: int, pool_mb: float | None = None) -> bool:
    """True when out_dir holds a complete build for this seed, pool size and interpreter."""
    out, card = Path(out_dir), read_card(out_dir)
    if card is None or card.get("seed") != seed or card.get("format_version") != FORMAT_VERSION:
        return False
    if card.get("pool_mb") != pool_mb:
        return False
    if card.get("python_version") != platform.python_version():
        return False
    return files_match(out, card)


def build_default_corpus(
    out_dir: str | Path, seed: int = 0, force: bool = False, pool_mb: float | None = None
) -> dict:
    """Write pool/target/val jsonl files and card.json to out_dir; return the card.

    ``pool_mb`` resamples the pool to that many MB (None: the pool as built). An existing
    up-to-date build (same seed, pool size, interpreter and file hashes) is kept unless `force`.
    """
    out = Path(out_dir)
    if not force and is_up_to_date(out, seed, pool_mb):
        return read_card(out)
    splits = build_splits(seed)
    if pool_mb is not None:
        splits["pool"] = resample_pool(splits["pool"], pool_mb, seed)
    return write_corpus(out, splits, _card(splits, seed, pool_mb))


def render_card_markdown(card: dict) -> str:
    """Markdown table of documents and MB (10^6 UTF-8 bytes) per domain and split."""
    return domain_table(card, DOMAINS)


def build_parser(parent: ActionSubCommands | None = None, name: str = "corpus") -> ArgumentParser:
    """The ``corpus`` command, standalone or as subcommand ``name`` of ``parent``."""
    description = __doc__.splitlines()[0]
    parser = ArgumentParser(prog="python -m selection_callbacks.data.default_corpus", description=description)
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--seed", type=int, default=0, help="seed for sampling and splitting")
    parser.add_argument("--force", action="store_true", help="rebuild even if up to date")
    parser.add_argument("--pool-mb", type=float | None, default=None,
                        help="resample the pool to this many MB (10^6 UTF-8 bytes); default: the pool as built")
    if parent is not None:
        parent.add_subcommand(name, parser, help=description)
    return parser


def run(args: Namespace) -> int:
    """Build (or keep) the corpus a ``build_parser()`` namespace describes and print its card; 0."""
    out = Path(args.out)
    keep = not args.force and is_up_to_date(out, args.seed, args.pool_mb)
    return build_or_keep(out, keep, lambda: build_default_corpus(out, args.seed, force=True, pool_mb=args.pool_mb), "default corpus", args.seed, render_card_markdown)


def main(argv: list[str] | None = None) -> int:
    """``python -m selection_callbacks.data.default_corpus``: parse ``argv`` and build; the exit status."""
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
