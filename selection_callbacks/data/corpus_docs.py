"""Documents of an offline-built corpus: chunking, capped filling and cross-split deduplication.

Shared by the corpus builders (:mod:`selection_callbacks.data.default_corpus`,
:mod:`selection_callbacks.data.package_corpus`, :mod:`selection_callbacks.data.debian_corpus`): a source text becomes documents of at most
``MAX_DOC_BYTES`` UTF-8 bytes cut at paragraph, then line, breaks; a domain is filled to a byte cap
in a seeded order; a text that appears in a held-out split is dropped from the pool.
"""

from __future__ import annotations

import hashlib
import json
import random
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import chain, zip_longest
from pathlib import Path

SPLITS = ("pool", "target", "val")
HELDOUT_SPLITS = ("target", "val")
SPLIT_FILES = {split: f"{split}.jsonl" for split in SPLITS}
CARD_FILE = "card.json"
MAX_DOC_BYTES = 8192
MIN_DOC_BYTES = 300


@dataclass(frozen=True)
class Doc:
    """One corpus document; `group` keys documents that must share a split."""

    id: str
    text: str
    domain: str
    group: str

    @property
    def nbytes(self) -> int:
        """UTF-8 size of the text."""
        return nbytes(self.text)


def rng_for(seed: int, name: str) -> random.Random:
    """An independent, reproducible random stream per purpose."""
    return random.Random(f"{seed}/{name}")


def shuffled(items: Iterable[Doc], rng: random.Random) -> list[Doc]:
    """The items as a list in an order drawn from ``rng``."""
    items = list(items)
    rng.shuffle(items)
    return items


def nbytes(text: str) -> int:
    """UTF-8 size of ``text``."""
    return len(text.encode("utf-8"))


def pack(pieces: list[str], sep: str, limit: int) -> list[str]:
    """Greedily join pieces (each <= limit bytes) into chunks of <= limit bytes."""
    chunks: list[str] = []
    current: list[str] = []
    size = 0
    sep_size = nbytes(sep)
    for piece in pieces:
        piece_size = nbytes(piece)
        if current and size + sep_size + piece_size > limit:
            chunks.append(sep.join(current))
            current, size = [], 0
        size += piece_size + (sep_size if current else 0)
        current.append(piece)
    if current:
        chunks.append(sep.join(current))
    return chunks


def chunk(text: str, limit: int = MAX_DOC_BYTES) -> list[str]:
    """Split text into pieces of <= limit UTF-8 bytes at paragraph, then line, breaks."""
    if nbytes(text) <= limit:
        return [text]
    for sep in ("\n\n", "\n"):
        parts = text.split(sep)
        if len(parts) > 1:
            return pack([p for part in parts for p in chunk(part, limit)], sep, limit)
    raw = text.encode("utf-8")
    return [raw[i : i + limit].decode("utf-8", "ignore") for i in range(0, len(raw), limit)]


def docs_from(domain: str, name: str, text: str, group: str | None = None) -> list[Doc]:
    """Chunk one source text into documents, dropping chunks under MIN_DOC_BYTES."""
    pieces = (piece.rstrip().lstrip("\n") for piece in chunk(text.strip()))
    return [
        Doc(f"{domain}/{name}#{i}", piece, domain, group or f"{domain}/{name}")
        for i, piece in enumerate(pieces)
        if nbytes(piece) >= MIN_DOC_BYTES
    ]


def fill(docs: Iterable[Doc], cap: float) -> list[Doc]:
    """Take docs in order, skipping repeated texts, until the next would exceed cap bytes."""
    taken: list[Doc] = []
    seen: set[str] = set()
    total = 0
    for doc in docs:
        if doc.text in seen:
            continue
        if total + doc.nbytes > cap:
            break
        seen.add(doc.text)
        taken.append(doc)
        total += doc.nbytes
    return taken


def round_robin(streams: list[Iterator[Doc]]) -> Iterator[Doc]:
    """One document from each stream in turn until all are spent."""
    return (d for d in chain.from_iterable(zip_longest(*streams)) if d is not None)


def dedupe_across(splits: dict[str, list[Doc]]) -> dict[str, list[Doc]]:
    """Keep the first occurrence of each text, held-out splits first."""
    seen: set[str] = set()
    result: dict[str, list[Doc]] = {}
    for split in (*HELDOUT_SPLITS, "pool"):
        result[split] = []
        for doc in splits[split]:
            if doc.text not in seen:
                seen.add(doc.text)
                result[split].append(doc)
    return {split: result[split] for split in SPLITS}


def jsonl_bytes(docs: list[Doc]) -> bytes:
    """One ``{"id", "text", "domain"}`` JSON line per document, UTF-8."""
    lines = (json.dumps({"id": d.id, "text": d.text, "domain": d.domain}) + "\n" for d in docs)
    return "".join(lines).encode("utf-8")


def domain_stats(docs: list[Doc], domains: Iterable[str]) -> dict[str, dict[str, int]]:
    """``{domain: {"docs", "bytes"}}`` for every listed domain (zeros included)."""
    stats = {domain: {"docs": 0, "bytes": 0} for domain in domains}
    for doc in docs:
        stats[doc.domain]["docs"] += 1
        stats[doc.domain]["bytes"] += doc.nbytes
    return stats


def write_corpus(out: Path, splits: dict[str, list[Doc]], card: dict) -> dict:
    """Write each split as ``<split>.jsonl`` and ``card.json`` (the card plus each file's sha256) to ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    hashes = {}
    for split, filename in SPLIT_FILES.items():
        payload = jsonl_bytes(splits[split])
        (out / filename).write_bytes(payload)
        hashes[filename] = hashlib.sha256(payload).hexdigest()
    card = {**card, "sha256": hashes}
    (out / CARD_FILE).write_text(json.dumps(card, indent=2) + "\n", encoding="utf-8", newline="\n")
    return card


def read_card(out_dir: str | Path) -> dict | None:
    """The card in out_dir, or None when missing or unreadable."""
    try:
        card = json.loads((Path(out_dir) / CARD_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return card if isinstance(card, dict) else None


def files_match(out_dir: str | Path, card: dict) -> bool:
    """Every split file exists in out_dir with the sha256 its card records."""
    out, hashes = Path(out_dir), card.get("sha256") or {}
    return all((out / f).is_file() and hashes.get(f) == hashlib.sha256((out / f).read_bytes()).hexdigest()
               for f in SPLIT_FILES.values())


def domain_table(card: dict, domains: Sequence[str]) -> str:
    """Markdown table of documents and MB (10^6 UTF-8 bytes) per domain and split, with a total row."""
    splits = card["splits"]
    rows = ["| domain | " + " | ".join(f"{s} docs | {s} MB" for s in SPLITS) + " |", "|---|" + "---:|---:|" * len(SPLITS)]
    for domain in (*domains, "total"):
        cells = []
        for split in SPLITS:
            stats = list(splits[split].values()) if domain == "total" else [splits[split][domain]]
            cells += [str(sum(s["docs"] for s in stats)), f"{sum(s['bytes'] for s in stats) / 1e6:.3f}"]
        rows.append(f"| {f'**{domain}**' if domain == 'total' else domain} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def build_or_keep(out: Path, up_to_date: bool, build: Callable[[], dict], what: str, seed: int,
                  render: Callable[[dict], str]) -> int:
    """A corpus command's body: keep an up-to-date build or run ``build``, print the card; 0."""
    if up_to_date:
        print(f"{out}: up to date (seed {seed})")
        card = read_card(out)
    else:
        start = time.perf_counter()
        card = build()
        print(f"built {what} in {time.perf_counter() - start:.1f}s -> {out}")
    print(render(card))
    return 0
