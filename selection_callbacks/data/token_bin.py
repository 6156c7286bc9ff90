"""Pre-tokenized pools: nanoGPT-style ``.bin`` files of uint16 token ids.

Two layouts are read: raw uint16 ids (nanoGPT's ``prepare.py``) and llm.c's, a 256×int32
header (magic 20240520, version, token count) followed by uint16 ids. Documents are split
after each end-of-text id (GPT-2: 50256). Bits-per-byte needs the UTF-8 length of every token,
which only the tokenizer's vocabulary knows: pass it as a ``.npy`` (``token_bytes``), e.g.
made where tiktoken is installed::

    python -c "import numpy as np, tiktoken; e = tiktoken.get_encoding('gpt2');
               np.save('gpt2_token_bytes.npy', [len(e.decode_single_token_bytes(i)) for i in range(e.n_vocab)])"

Without it validation reports loss only.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import torch

from selection_callbacks.core.io import atomic_path
from selection_callbacks.data.packing import PackedSplit
from selection_callbacks.data.readers import DataSourceError

LLMC_MAGIC = 20240520
HEADER_INT32 = 256


def token_bin_view(path: str | Path) -> np.ndarray:
    """uint16 memmap of the ids in ``path`` (either layout)."""
    p = Path(path)
    if not p.is_file():
        raise DataSourceError(f"token file {str(p)!r} does not exist")
    size = p.stat().st_size
    with open(p, "rb") as f:
        head = np.frombuffer(f.read(12), dtype=np.int32) if size >= 12 else np.zeros(0, dtype=np.int32)
    if head.size == 3 and head[0] == LLMC_MAGIC:
        count = int(head[2])
        if HEADER_INT32 * 4 + 2 * count > size:
            raise DataSourceError(f"{p}: llm.c header announces {count} tokens but the file is {size} bytes")
        return np.memmap(p, dtype=np.uint16, mode="r", offset=HEADER_INT32 * 4, shape=(count,))
    if size % 2:
        raise DataSourceError(f"{p}: odd byte count {size}; not a uint16 token file")
    return np.memmap(p, dtype=np.uint16, mode="r")


def load_token_bin(path: str | Path, seq_len: int, cache_dir: str | Path, eot_id: int, name: str = "split") -> PackedSplit:
    """A :class:`PackedSplit` over the file's ids in place (document starts cached once)."""
    tokens = token_bin_view(path)
    if tokens.shape[0] < seq_len + 1:
        raise DataSourceError(f"{name} source {str(path)!r} has {tokens.shape[0]} tokens, fewer than seq_len+1={seq_len + 1}")
    st = Path(path).stat()
    key = hashlib.sha256(f"bin|{Path(path).resolve()}|{st.st_size}|{st.st_mtime_ns}|{eot_id}".encode()).hexdigest()[:20]
    starts_file = Path(cache_dir) / f"{key}.doc_start.npy"
    if starts_file.exists():
        starts = np.load(starts_file)
    else:
        ends = np.flatnonzero(tokens == eot_id)
        starts = np.concatenate([[0], ends[ends < tokens.shape[0] - 1] + 1]).astype(np.int64)
        starts_file.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(starts_file, ".npy") as tmp:  # ranks building the same cache never read a partial file
            np.save(tmp, starts)
    n = (tokens.shape[0] - 1) // seq_len
    return PackedSplit(
        tokens=tokens,
        seq_len=seq_len,
        doc_ids=np.asarray([f"{Path(path).name}:{i}" for i in range(len(starts))], dtype=str),
        doc_start=starts,
        sample_domain=np.zeros(n, dtype=np.int64),
        domain_names=["default"],
        name=name,
    )


class PretokenizedTokenizer:
    """Stands in for the tokenizer of ``.bin`` pools: its vocabulary size and token byte lengths."""

    def __init__(self, vocab_size: int, token_bytes: str | None = None) -> None:
        self.vocab_size = vocab_size
        self._bytes = None
        if token_bytes is not None:
            arr = np.load(token_bytes)
            if arr.ndim != 1 or arr.shape[0] > vocab_size:
                raise ValueError(f"token_bytes {token_bytes!r} must be a 1-D array of at most vocab_size={vocab_size}")
            self._bytes = torch.as_tensor(arr, dtype=torch.float32)

    def token_bytes(self, vocab_size: int | None = None) -> torch.Tensor | None:
        """Bytes per id [vocab_size] (0 beyond the file), or None when unknown."""
        if self._bytes is None:
            return None
        out = torch.zeros(max(vocab_size or self.vocab_size, self._bytes.shape[0]))
        out[: self._bytes.shape[0]] = self._bytes
        return out
