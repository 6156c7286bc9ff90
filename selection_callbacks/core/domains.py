"""Domain codes to names, as the ledger, the dashboard and the ``select/domain/*`` metrics show them."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

__all__ = ["domain_name", "domain_names"]


def domain_name(code: int, names: Sequence[str] | None) -> str:
    """``names[code]``, or the code as text when there are no names or the code is out of range."""
    return names[code] if names is not None and 0 <= code < len(names) else str(code)


def domain_names(codes: Iterable[int], names: Sequence[str] | None) -> list[str]:
    """:func:`domain_name` of each code."""
    return [domain_name(code, names) for code in codes]
