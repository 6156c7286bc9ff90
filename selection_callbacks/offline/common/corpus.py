"""What every offline selector shares: documents with token counts, the budget rule and Gumbel-top-k.

``gumbel_order`` (indices by descending log-weight + Gumbel noise) is
:func:`selection_callbacks.core.sampling.gumbel_order`, re-exported here.

A selector ranks pool documents (deterministically, or by sampling without replacement) and
:meth:`Budget.take` keeps the shortest prefix of that ranking that meets the budget: ``docs=N``
keeps exactly N documents; ``tokens=B`` keeps the fewest documents whose tokens (ByteTokenizer:
UTF-8 bytes + 1 boundary token each) reach B, so a subset holds ≥ B tokens and < B + the last
document's length.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from selection_callbacks.core.sampling import gumbel_order
from selection_callbacks.data.readers import iter_documents
from selection_callbacks.data.tokenizer import ByteTokenizer

__all__ = ["Budget", "Corpus", "Selection", "SelectionError", "gumbel_order", "load_corpus"]


class SelectionError(ValueError):
    """A selection that cannot be made as asked (empty split, budget beyond the pool, ...)."""


@dataclass(frozen=True)
class Corpus:
    """The documents of one split, in source order.

    Attributes:
        path: where they were read from.
        ids: str [D], unique document ids.
        domains: str [D], domain labels.
        texts: D strings.
        n_tokens: int64 [D], ByteTokenizer tokens per document (UTF-8 bytes + 1 BOS).
    """

    path: str
    ids: np.ndarray
    domains: np.ndarray
    texts: list[str]
    n_tokens: np.ndarray

    def __len__(self) -> int:
        return len(self.texts)

    @property
    def tokenizer(self) -> ByteTokenizer:
        """The tokenizer of :meth:`tokens` and ``n_tokens``: UTF-8 bytes and a boundary token (``vocab_size``
        257, ``bos_id`` 256), what a proxy trained on these documents embeds."""
        return ByteTokenizer()

    def tokens(self, i: int) -> np.ndarray:
        """uint16 ``[BOS] + utf8(text)`` of document ``i``."""
        return self.tokenizer.encode_document(self.texts[i])


def load_corpus(path: str | Path, name: str = "pool") -> Corpus:
    """Read a split with :func:`iter_documents`; an empty split or repeated ids are errors."""
    docs = list(iter_documents(path))
    if not docs:
        raise SelectionError(f"{name} {str(path)!r} holds no documents: nothing to select from or match")
    ids = np.asarray([d.id for d in docs], dtype=str)
    uniq, counts = np.unique(ids, return_counts=True)
    if (counts > 1).any():
        raise SelectionError(
            f"{name} {str(path)!r} repeats document ids (e.g. {uniq[counts > 1][:3].tolist()}); "
            "a doc_id subset needs unique ids"
        )
    return Corpus(
        path=str(path),
        ids=ids,
        domains=np.asarray([d.domain for d in docs], dtype=str),
        texts=[d.text for d in docs],
        n_tokens=np.asarray([len(d.text.encode("utf-8", errors="replace")) + 1 for d in docs], dtype=np.int64),
    )


@dataclass(frozen=True)
class Budget:
    """How much to select: exactly ``docs`` documents, or ``tokens`` tokens (the prefix rule above).

    Attributes:
        tokens: token budget B.
        docs: document budget N.
    """

    tokens: int | None = None
    docs: int | None = None

    def __post_init__(self) -> None:
        if (self.tokens is None) == (self.docs is None):
            raise SelectionError("give exactly one budget: tokens or docs")
        value = self.tokens if self.tokens is not None else self.docs
        if value < 1:
            raise SelectionError(f"the budget must be ≥ 1, got {value}")

    def check(self, corpus: Corpus) -> None:
        """Error when the pool cannot hold the budget."""
        if self.docs is not None and self.docs > len(corpus):
            raise SelectionError(f"budget of {self.docs} documents is larger than the pool's {len(corpus)}")
        total = int(corpus.n_tokens.sum())
        if self.tokens is not None and self.tokens > total:
            raise SelectionError(f"budget of {self.tokens} tokens is larger than the pool's {total}")

    def take(self, order: np.ndarray, n_tokens: np.ndarray) -> np.ndarray:
        """The shortest prefix of ``order`` (document indices, best first) that meets the budget."""
        order = np.asarray(order, dtype=np.int64)
        if self.docs is not None:
            if order.size < self.docs:
                raise SelectionError(f"only {order.size} eligible documents for a budget of {self.docs}")
            return order[: self.docs]
        cum = np.cumsum(n_tokens[order])
        if cum.size == 0 or cum[-1] < self.tokens:
            have = int(cum[-1]) if cum.size else 0
            raise SelectionError(f"only {have} tokens in {order.size} eligible documents for a budget of {self.tokens}")
        return order[: int(np.searchsorted(cum, self.tokens)) + 1]

    def describe(self) -> str:
        return f"{self.docs} documents" if self.docs is not None else f"{self.tokens} tokens"


@dataclass
class Selection:
    """A selector's answer.

    Attributes:
        indices: int64 [S], chosen pool documents in the order they were picked.
        info: method details for the summary (JSON-serialisable).
    """

    indices: np.ndarray
    info: dict[str, Any] = field(default_factory=dict)
