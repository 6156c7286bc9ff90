"""What every reader yields: :class:`Document`, the column names it reads (:class:`Columns`), and its error."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Columns", "DataSourceError", "Document", "row_document"]


@dataclass(frozen=True)
class Document:
    """One source document: a stable id, its text and a domain label."""

    id: str
    text: str
    domain: str


@dataclass(frozen=True)
class Columns:
    """Which row fields hold a document's text, id and domain.

    A missing ``id`` field gives ``<file or dataset name>:<row>``; a missing ``domain`` field (or
    ``domain=None``) gives ``"default"``. Only ``text`` is required.
    """

    text: str = "text"
    id: str | None = "id"
    domain: str | None = "domain"


class DataSourceError(ValueError):
    """A data file or folder that cannot be read as documents."""


def row_document(row: dict, default_id: str, where: str, columns: Columns = Columns()) -> Document:
    """The :class:`Document` of one jsonl/parquet/dataset row; ``where`` names the row in errors."""
    if not isinstance(row, dict) or columns.text not in row:
        found = sorted(row) if isinstance(row, dict) else type(row).__name__
        raise DataSourceError(
            f"{where}: each row needs a {columns.text!r} field (optional {columns.id!r}, {columns.domain!r}), "
            f"found {found}; name the text field with data.text_column"
        )
    text = row[columns.text]
    if not isinstance(text, str):
        raise DataSourceError(f"{where}: {columns.text!r} must be a string, got {type(text).__name__}")
    doc_id = row.get(columns.id) if columns.id else None
    domain = row.get(columns.domain) if columns.domain else None
    return Document(
        id=default_id if doc_id is None else str(doc_id),
        text=text,
        domain="default" if domain is None else str(domain),
    )
