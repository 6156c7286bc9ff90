"""Read documents from jsonl, parquet or a folder of text files."""

from __future__ import annotations

import codecs
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

TEXT_SUFFIXES = (".txt", ".md", ".rst", ".text")


@dataclass(frozen=True)
class Document:
    """One source document: a stable id, its text and a domain label."""

    id: str
    text: str
    domain: str


class DataSourceError(ValueError):
    """A data file or folder that cannot be read as documents."""


def source_files(path: str | Path) -> list[Path]:
    """Files that make up a source: the file itself, or the text files under a folder (sorted)."""
    p = Path(path)
    if not p.exists():
        raise DataSourceError(f"data source {str(p)!r} does not exist; pass a .jsonl, .parquet or a folder of text files")
    if p.is_file():
        return [p]
    files = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix.lower() in TEXT_SUFFIXES + (".jsonl", ".parquet"))
    if not files:
        raise DataSourceError(f"folder {str(p)!r} holds no {', '.join(TEXT_SUFFIXES)}, .jsonl or .parquet files")
    return files


def check_source(path: str | Path) -> list[Path]:
    """The source's files, after checking that each exists and that every jsonl file is UTF-8.

    Cheap next to tokenizing (one read of the bytes), so a datamodule runs it on every split
    before packing any: a bad byte or a missing file is named, with file and line, up front.
    """
    files = source_files(path)
    for f in files:
        if f.suffix.lower() == ".jsonl":
            _check_utf8(f)
    return files


def _check_utf8(f: Path) -> None:
    decoder = codecs.getincrementaldecoder("utf-8")()
    try:
        with f.open("rb") as handle:
            while chunk := handle.read(1 << 24):
                decoder.decode(chunk)
            decoder.decode(b"", final=True)
    except UnicodeDecodeError:
        _raise_at_bad_line(f)
    except OSError as e:
        raise DataSourceError(f"cannot read {str(f)!r}: {e}") from e


def _raise_at_bad_line(f: Path) -> None:
    """Find the first line of ``f`` that is not UTF-8 and raise a :class:`DataSourceError` naming it."""
    with f.open("rb") as handle:
        for i, raw in enumerate(handle):
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataSourceError(
                    f"{f}:{i + 1}: byte 0x{raw[e.start]:02x} at column {e.start + 1} is not UTF-8 ({e.reason}); "
                    "re-encode the file as UTF-8 (e.g. iconv -f latin1 -t utf-8) or drop the line"
                ) from None


def iter_documents(path: str | Path) -> Iterator[Document]:
    """Yield every document of a source in a stable order.

    jsonl/parquet rows need ``text``; ``id`` defaults to ``<file>:<row>`` and ``domain`` to
    ``"default"``. A text file is one document whose domain is its parent folder's name.
    """
    root = Path(path)
    for f in source_files(root):
        suffix = f.suffix.lower()
        if suffix == ".jsonl":
            yield from _iter_jsonl(f)
        elif suffix == ".parquet":
            yield from _iter_parquet(f)
        else:
            rel = f.relative_to(root) if root.is_dir() else Path(f.name)
            domain = rel.parent.name if rel.parent != Path(".") else "default"
            try:
                text = f.read_text(encoding="utf-8", errors="replace")
            except OSError as e:
                raise DataSourceError(f"cannot read {str(f)!r}: {e}") from e
            yield Document(id=str(rel), text=text, domain=domain)


def _row_document(row: dict, default_id: str, where: str) -> Document:
    if not isinstance(row, dict) or "text" not in row:
        raise DataSourceError(f"{where}: each row needs a 'text' field (optional 'id', 'domain')")
    text = row["text"]
    if not isinstance(text, str):
        raise DataSourceError(f"{where}: 'text' must be a string, got {type(text).__name__}")
    doc_id = row.get("id")
    domain = row.get("domain")
    return Document(
        id=default_id if doc_id is None else str(doc_id),
        text=text,
        domain="default" if domain is None else str(domain),
    )


def _iter_jsonl(f: Path) -> Iterator[Document]:
    try:
        handle = f.open("rb")
    except OSError as e:
        raise DataSourceError(f"cannot read {str(f)!r}: {e}") from e
    with handle:
        for i, raw in enumerate(handle):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                _raise_at_bad_line(f)
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataSourceError(f"{f}:{i + 1}: not valid JSON ({e.msg})") from e
            yield _row_document(row, f"{f.name}:{i}", f"{f}:{i + 1}")


def _iter_parquet(f: Path) -> Iterator[Document]:
    import pyarrow.parquet as pq

    try:
        table = pq.ParquetFile(f)
    except Exception as e:  # pyarrow raises several types for corrupt files
        raise DataSourceError(f"cannot read parquet {str(f)!r}: {e}") from e
    if "text" not in table.schema_arrow.names:
        raise DataSourceError(f"{f}: parquet needs a 'text' column, found {table.schema_arrow.names}")
    row = 0
    for batch in table.iter_batches():
        for rec in batch.to_pylist():
            yield _row_document(rec, f"{f.name}:{row}", f"{f} row {row}")
            row += 1
