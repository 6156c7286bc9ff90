"""Documents from Hugging Face ``datasets``: a dataset saved with ``save_to_disk``, ``.arrow`` files, and
streaming iteration over those and over local jsonl/parquet files.

Row ``i`` of a source gets the id in its ``id`` column, else ``<name>:<i>`` where ``name`` is the file
name (per file, as :mod:`selection_callbacks.data.readers` names jsonl/parquet rows) or, for a saved
dataset, its folder name. Streaming reads every file in order without shuffling, so a streamed source
yields the same documents, ids and order as its map-style read; a training order is made downstream
(:mod:`selection_callbacks.data.stream_loader`). ``datasets`` is imported only when one of these sources
is read, and nothing is downloaded: every reader here takes local paths.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from selection_callbacks.data.documents import Columns, DataSourceError, Document, row_document

__all__ = ["SAVED_DATASET_MARKERS", "is_saved_dataset", "iter_arrow_file", "iter_saved_dataset", "stream_file",
           "stream_saved_dataset"]

SAVED_DATASET_MARKERS = ("state.json", "dataset_info.json")
STREAM_BUILDERS = {".jsonl": "json", ".parquet": "parquet", ".arrow": "arrow"}


def _datasets():
    try:
        import datasets
    except ImportError as e:
        raise DataSourceError(
            "reading a Hugging Face dataset needs the `datasets` package: pip install 'selection-callbacks[hf]' "
            "(or pip install datasets)"
        ) from e
    datasets.disable_progress_bars()
    return datasets


def is_saved_dataset(path: str | Path) -> bool:
    """True for a folder written by ``save_to_disk``: a Dataset (``state.json`` beside its ``.arrow`` shards) or a
    DatasetDict (``dataset_dict.json``; reading it asks for one split's folder)."""
    p = Path(path)
    return p.is_dir() and (all((p / m).is_file() for m in SAVED_DATASET_MARKERS) or (p / "dataset_dict.json").is_file())


def _load_saved(path: Path):
    if (path / "dataset_dict.json").is_file():
        splits = sorted(d.name for d in path.iterdir() if d.is_dir())
        raise DataSourceError(
            f"{str(path)!r} is a saved DatasetDict with splits {splits}; pass one split's folder, "
            f"e.g. {str(path / (splits[0] if splits else 'train'))!r}"
        )
    try:
        return _datasets().load_from_disk(str(path))
    except DataSourceError:
        raise
    except Exception as e:  # datasets raises several types for damaged folders
        raise DataSourceError(f"cannot load the saved dataset {str(path)!r}: {e}") from e


def _rows(rows, name: str, where: str, columns: Columns, skip: int = 0) -> Iterator[Document]:
    for i, row in enumerate(rows, start=skip):
        yield row_document(row, f"{name}:{i}", f"{where} row {i}", columns)


def _check_text_column(column_names: list[str] | None, where: str, columns: Columns) -> None:
    if column_names is not None and columns.text not in column_names:
        raise DataSourceError(
            f"{where}: no {columns.text!r} column, found {column_names}; name the text column with data.text_column"
        )


def iter_saved_dataset(path: str | Path, columns: Columns = Columns()) -> Iterator[Document]:
    """The rows of a saved dataset (memory-mapped), in order."""
    p = Path(path)
    ds = _load_saved(p)
    _check_text_column(ds.column_names, str(p), columns)
    yield from _rows(iter(ds), p.name, str(p), columns)


def stream_saved_dataset(path: str | Path, columns: Columns = Columns(), skip: int = 0) -> Iterator[Document]:
    """The rows of a saved dataset through ``to_iterable_dataset()`` (one shard, in order), the first ``skip`` left out."""
    p = Path(path)
    ds = _load_saved(p)
    _check_text_column(ds.column_names, str(p), columns)
    stream = ds.to_iterable_dataset(num_shards=1)
    yield from _rows(stream.skip(skip) if skip else stream, p.name, str(p), columns, skip)


def iter_arrow_file(f: Path, columns: Columns = Columns()) -> Iterator[Document]:
    """The rows of one ``.arrow`` file (a ``datasets`` shard), memory-mapped, in order."""
    try:
        ds = _datasets().Dataset.from_file(str(f))
    except DataSourceError:
        raise
    except Exception as e:
        raise DataSourceError(f"cannot read arrow file {str(f)!r}: {e}") from e
    _check_text_column(ds.column_names, str(f), columns)
    yield from _rows(iter(ds), f.name, str(f), columns)


def stream_file(f: Path, columns: Columns = Columns(), skip: int = 0) -> Iterator[Document]:
    """The rows of one jsonl/parquet/arrow file through ``load_dataset(..., streaming=True)``, the first ``skip`` left out."""
    builder = STREAM_BUILDERS.get(f.suffix.lower())
    if builder is None:
        raise DataSourceError(f"{str(f)!r}: streaming reads {', '.join(STREAM_BUILDERS)} files")
    try:
        stream = _datasets().load_dataset(builder, data_files=[str(f)], split="train", streaming=True)
    except DataSourceError:
        raise
    except Exception as e:
        raise DataSourceError(f"cannot stream {str(f)!r}: {e}") from e
    _check_text_column(stream.column_names, str(f), columns)
    yield from _rows(stream.skip(skip) if skip else stream, f.name, str(f), columns, skip)
