"""Read documents from jsonl, parquet, a folder of text files, or Hugging Face ``datasets`` sources.

The one place that turns a source path into :class:`Document` s: the pool datamodule, the offline
selectors and the feature bank all read through :func:`iter_documents` (or, streaming,
:func:`stream_documents`). A folder holding ``state.json`` and ``dataset_info.json`` is a dataset
saved with ``save_to_disk``; ``.arrow`` files are ``datasets`` shards
(:mod:`selection_callbacks.data.hf_datasets`).
"""

from __future__ import annotations

import codecs
import itertools
import json
from collections.abc import Iterator
from pathlib import Path

from selection_callbacks.data import hf_datasets
from selection_callbacks.data.documents import Columns, DataSourceError, Document, row_document

__all__ = ["Columns", "DataSourceError", "Document", "check_source", "iter_documents", "source_files",
           "stream_documents"]

TEXT_SUFFIXES = (".txt", ".md", ".rst", ".text")
ROW_SUFFIXES = (".jsonl", ".parquet", ".arrow")


def source_files(path: str | Path) -> list[Path]:
    """Files that make up a source: the file itself, a saved dataset's files, or the text/row files under a folder (sorted)."""
    p = Path(path)
    if not p.exists():
        raise DataSourceError(
            f"data source {str(p)!r} does not exist; pass a .jsonl, .parquet or .arrow file, a folder of text files "
            "or a folder written by datasets' save_to_disk"
        )
    if p.is_file():
        return [p]
    if hf_datasets.is_saved_dataset(p):
        return sorted(f for f in p.iterdir() if f.is_file())
    files = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix.lower() in TEXT_SUFFIXES + ROW_SUFFIXES)
    if not files:
        raise DataSourceError(f"folder {str(p)!r} holds no {', '.join(TEXT_SUFFIXES + ROW_SUFFIXES)} files")
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


def iter_documents(path: str | Path, columns: Columns = Columns()) -> Iterator[Document]:
    """Yield every document of a source in a stable order.

    jsonl/parquet/arrow/dataset rows need ``columns.text``; the id defaults to ``<file>:<row>``
    (``<dataset folder>:<row>`` for a saved dataset) and the domain to ``"default"``
    (:class:`Columns`). A text file is one document whose domain is its parent folder's name.
    """
    root = Path(path)
    if hf_datasets.is_saved_dataset(root):
        yield from hf_datasets.iter_saved_dataset(root, columns)
        return
    for f in source_files(root):
        suffix = f.suffix.lower()
        if suffix == ".jsonl":
            yield from _iter_jsonl(f, columns)
        elif suffix == ".parquet":
            yield from _iter_parquet(f, columns)
        elif suffix == ".arrow":
            yield from hf_datasets.iter_arrow_file(f, columns)
        else:
            rel = f.relative_to(root) if root.is_dir() else Path(f.name)
            domain = rel.parent.name if rel.parent != Path(".") else "default"
            try:
                text = f.read_text(encoding="utf-8", errors="replace")
            except OSError as e:
                raise DataSourceError(f"cannot read {str(f)!r}: {e}") from e
            yield Document(id=str(rel), text=text, domain=domain)


def stream_documents(path: str | Path, columns: Columns = Columns(), skip: int = 0) -> Iterator[Document]:
    """The documents of :func:`iter_documents`, in the same order with the same ids, read through
    ``datasets`` streaming (jsonl/parquet/arrow files, saved datasets); the first ``skip`` are left out.

    Text folders have no ``datasets`` form and are read as they are. A jsonl row's default id counts
    lines in :func:`iter_documents` and rows here, so the two agree when the file has no blank lines
    or an id column.
    """
    root = Path(path)
    if hf_datasets.is_saved_dataset(root):
        yield from hf_datasets.stream_saved_dataset(root, columns, skip)
        return
    if root.is_dir():
        yield from itertools.islice(iter_documents(root, columns), skip, None)
        return
    yield from hf_datasets.stream_file(root, columns, skip)


def _iter_jsonl(f: Path, columns: Columns) -> Iterator[Document]:
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
            yield row_document(row, f"{f.name}:{i}", f"{f}:{i + 1}", columns)


def _iter_parquet(f: Path, columns: Columns) -> Iterator[Document]:
    import pyarrow.parquet as pq

    try:
        table = pq.ParquetFile(f)
    except Exception as e:  # pyarrow raises several types for corrupt files
        raise DataSourceError(f"cannot read parquet {str(f)!r}: {e}") from e
    if columns.text not in table.schema_arrow.names:
        raise DataSourceError(
            f"{f}: parquet needs a {columns.text!r} column, found {table.schema_arrow.names}; "
            "name the text column with data.text_column"
        )
    row = 0
    for batch in table.iter_batches():
        for rec in batch.to_pylist():
            yield row_document(rec, f"{f.name}:{row}", f"{f} row {row}", columns)
            row += 1
