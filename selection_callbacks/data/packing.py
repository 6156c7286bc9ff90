"""Pack documents into one token stream, cached once as a memory-mapped file.

Sample ``s`` of a split is the window ``stream[s*T : s*T + T + 1]`` (inputs are its first T
tokens, labels its last T), so every token is predicted exactly once and ``sample_id = s`` is
stable for a given source, tokenizer and T.

A tokenizer with ``per_token_bytes`` (:class:`~selection_callbacks.data.hf_tokenizer.HFTokenizer`)
also writes each token's original UTF-8 bytes beside the stream, and batches carry them as
``label_bytes``, so bits per byte stays exact under subword tokenizers and normalisers.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from selection_callbacks.core.io import atomic_path
from selection_callbacks.data.readers import Columns, DataSourceError, iter_documents, source_files
from selection_callbacks.data.tokenizer import ByteTokenizer

CACHE_VERSION = 1


def source_key(
    path: str | Path, seq_len: int, tokenizer: ByteTokenizer, doc_filter: list[str] | None, columns: Columns = Columns()
) -> str:
    """Cache key: files (path, size, mtime), T, tokenizer, the optional document filter and non-default columns."""
    h = hashlib.sha256(f"v{CACHE_VERSION}|{tokenizer.fingerprint()}|T={seq_len}".encode())
    for f in source_files(path):
        st = f.stat()
        h.update(f"|{f.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode())
    if doc_filter is not None:
        h.update(b"|filter|" + "\n".join(doc_filter).encode())
    if columns != Columns():
        h.update(f"|columns|{columns.text}|{columns.id}|{columns.domain}".encode())
    return h.hexdigest()[:20]


@dataclass
class PackedSplit:
    """A packed, memory-mapped split.

    Attributes:
        tokens: uint16 (uint32 past 65,536 ids) stream [L].
        seq_len: T.
        doc_ids: str array [D], in stream order.
        doc_start: int64 [D], stream offset of each document's boundary token.
        sample_domain: int64 [S], majority domain of each sample's label tokens.
        domain_names: index → domain name.
        token_nbytes: optional uint32 [L], original UTF-8 bytes of each token (subword tokenizers).
    """

    tokens: np.ndarray
    seq_len: int
    doc_ids: np.ndarray
    doc_start: np.ndarray
    sample_domain: np.ndarray
    domain_names: list[str]
    name: str = "split"
    token_nbytes: np.ndarray | None = None

    def __len__(self) -> int:
        return int(self.sample_domain.shape[0])

    def _window_index(self, sample_ids: np.ndarray) -> np.ndarray:
        T = self.seq_len
        return np.asarray(sample_ids, dtype=np.int64)[:, None] * T + np.arange(T + 1)[None, :]

    def windows(self, sample_ids: np.ndarray) -> np.ndarray:
        """int64 [n, T+1] token windows."""
        return self.tokens[self._window_index(sample_ids)].astype(np.int64)

    def batch(self, sample_ids: np.ndarray) -> dict[str, torch.Tensor]:
        """The superbatch contract: ``input_ids``/``labels`` [n, T], ``sample_id`` and ``domain`` [n];
        with per-token bytes also ``label_bytes`` [n, T], the original UTF-8 bytes of each label."""
        sample_ids = np.asarray(sample_ids, dtype=np.int64)
        idx = self._window_index(sample_ids)
        w = torch.from_numpy(self.tokens[idx].astype(np.int64))
        out = {
            "input_ids": w[:, :-1].contiguous(),
            "labels": w[:, 1:].contiguous(),
            "sample_id": torch.from_numpy(sample_ids.copy()),
            "domain": torch.from_numpy(self.sample_domain[sample_ids].copy()),
        }
        if self.token_nbytes is not None:
            out["label_bytes"] = torch.from_numpy(self.token_nbytes[idx[:, 1:]].astype(np.int64))
        return out

    def sample_doc_ids(self, sample_id: int) -> list[str]:
        """Ids of the documents whose tokens sample ``sample_id`` holds."""
        T = self.seq_len
        first = int(np.searchsorted(self.doc_start, sample_id * T, side="right") - 1)
        last = int(np.searchsorted(self.doc_start, sample_id * T + T, side="right") - 1)
        return [str(d) for d in self.doc_ids[max(first, 0) : last + 1]]


def pack_source(
    path: str | Path,
    seq_len: int,
    cache_dir: str | Path,
    tokenizer: ByteTokenizer | None = None,
    doc_filter: list[str] | None = None,
    name: str = "split",
    progress: bool = True,
    columns: Columns = Columns(),
) -> PackedSplit:
    """Tokenize and pack ``path`` once into ``cache_dir/<key>/``, then memory-map it.

    ``doc_filter`` keeps only documents with those ids (a subset file's ``doc_id`` column);
    an id it names that the source lacks is an error. ``columns`` names the row fields read.
    """
    tokenizer = tokenizer or ByteTokenizer()
    key = source_key(path, seq_len, tokenizer, doc_filter, columns)
    folder = Path(cache_dir) / key
    if not (folder / "meta.json").exists():
        _build(path, seq_len, tokenizer, doc_filter, folder, name, progress, columns)
    return _load(folder, seq_len, name)


def _build(path, seq_len, tokenizer, doc_filter, folder: Path, name: str, progress: bool, columns: Columns) -> None:
    with atomic_path(folder, keep_existing=True) as tmp:  # another process may finish the same cache first
        tmp.mkdir(parents=True, exist_ok=True)
        _write_split(path, seq_len, tokenizer, doc_filter, tmp, name, progress, columns)


def _write_split(path, seq_len, tokenizer, doc_filter, tmp: Path, name: str, progress: bool, columns: Columns) -> None:
    """Tokenize ``path`` into the folder ``tmp``: tokens.bin (and token_nbytes.bin), doc starts, ids,
    per-sample domains, meta.json."""
    wanted = set(doc_filter) if doc_filter is not None else None
    per_token_bytes = getattr(tokenizer, "per_token_bytes", False)
    doc_ids: list[str] = []
    doc_start: list[int] = []
    doc_domain: list[int] = []
    domains: dict[str, int] = {}
    offset = 0
    dtype = "uint16"
    with open(tmp / "tokens.bin", "wb") as out, _maybe_open(tmp / "token_nbytes.bin", per_token_bytes) as out_bytes:
        docs = iter_documents(path, columns)
        for doc in tqdm(docs, desc=f"tokenizing {name}", unit="doc", disable=not progress):
            if wanted is not None and doc.id not in wanted:
                continue
            if per_token_bytes:
                ids, nbytes = tokenizer.encode_document_with_bytes(doc.text)
                out_bytes.write(nbytes.astype(np.uint32).tobytes())
            else:
                ids = tokenizer.encode_document(doc.text)
            dtype = ids.dtype.name
            out.write(ids.tobytes())
            doc_ids.append(doc.id)
            doc_start.append(offset)
            doc_domain.append(domains.setdefault(doc.domain, len(domains)))
            offset += ids.size
    if wanted is not None:
        missing = wanted.difference(doc_ids)
        if missing:
            example = sorted(missing)[:5]
            raise DataSourceError(
                f"subset names {len(missing)} doc_id(s) that {str(path)!r} does not contain, e.g. {example}; "
                "check that the subset file was made for this pool"
            )
    if not doc_ids:
        raise DataSourceError(f"{name} source {str(path)!r} holds no documents")
    if offset < seq_len + 1:
        raise DataSourceError(
            f"{name} source {str(path)!r} has {offset} tokens, fewer than one sequence of seq_len+1={seq_len + 1}; "
            "add text or lower data.seq_len"
        )
    starts = np.asarray(doc_start, dtype=np.int64)
    sample_domain = _majority_domain(starts, np.asarray(doc_domain, dtype=np.int64), offset, seq_len)
    np.save(tmp / "doc_start.npy", starts)
    np.save(tmp / "doc_ids.npy", np.asarray(doc_ids, dtype=str))
    np.save(tmp / "sample_domain.npy", sample_domain)
    meta = {"domains": list(domains), "tokens": offset, "docs": len(doc_ids), "dtype": dtype}
    (tmp / "meta.json").write_text(json.dumps(meta))


def _maybe_open(path: Path, wanted: bool):
    """``path`` opened for binary writing, or a no-op context when not ``wanted``."""
    return open(path, "wb") if wanted else contextlib.nullcontext()


def _majority_domain(starts: np.ndarray, doc_domain: np.ndarray, total: int, T: int) -> np.ndarray:
    """Domain holding the most label tokens of each sample (label tokens of s: [s*T+1, s*T+T])."""
    n = (total - 1) // T
    lo = np.arange(n, dtype=np.int64) * T + 1
    hi = lo + T  # exclusive
    first = np.searchsorted(starts, lo, side="right") - 1
    last = np.searchsorted(starts, hi - 1, side="right") - 1
    out = doc_domain[first].copy()
    ends = np.append(starts[1:], total)
    for s in np.nonzero(first != last)[0]:
        counts: dict[int, int] = {}
        for d in range(first[s], last[s] + 1):
            covered = min(ends[d], hi[s]) - max(starts[d], lo[s])
            counts[int(doc_domain[d])] = counts.get(int(doc_domain[d]), 0) + int(covered)
        out[s] = max(sorted(counts), key=lambda k: counts[k])
    return out


def _load(folder: Path, seq_len: int, name: str) -> PackedSplit:
    meta = json.loads((folder / "meta.json").read_text())
    shape = (meta["tokens"],)
    tokens = np.memmap(folder / "tokens.bin", dtype=meta.get("dtype", "uint16"), mode="r", shape=shape)
    nbytes_file = folder / "token_nbytes.bin"
    token_nbytes = np.memmap(nbytes_file, dtype=np.uint32, mode="r", shape=shape) if nbytes_file.exists() else None
    return PackedSplit(
        tokens=tokens,
        seq_len=seq_len,
        doc_ids=np.load(folder / "doc_ids.npy"),
        doc_start=np.load(folder / "doc_start.npy"),
        sample_domain=np.load(folder / "sample_domain.npy"),
        domain_names=list(meta["domains"]),
        name=name,
        token_nbytes=token_nbytes,
    )
