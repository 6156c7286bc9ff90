"""Superbatches from a streamed pool: packed on the fly, ordered by a seeded shuffle buffer, resumable mid-stream.

A stream has no global index to permute, so the order is made in two steps:

1. Packing. Documents are read in source order (:func:`~selection_callbacks.data.readers.stream_documents`)
   and packed exactly as :func:`~selection_callbacks.data.packing.pack_source` packs them: window ``s``
   is ``stream[s·T : s·T + T + 1]``, so ``sample_id = s`` (and its majority domain) is the id the
   packed pool gives the same window: the ledger, ``sample_id`` subsets and ``val`` stay comparable.
2. Shuffling. Windows pass through a buffer of ``buffer_size`` windows (default 1,024): once it is
   full (or the stream has ended) one uniformly drawn window leaves for each one that enters. Epoch
   ``e`` draws from ``numpy.random.default_rng([seed, e])``, as
   :class:`~selection_callbacks.data.loader.SuperbatchLoader` seeds its permutation, so the order
   depends on (seed, epoch) only. A window leaves at most ``buffer_size`` places before its
   source position would put it, so a larger buffer mixes domains that are grouped in the source.

Global superbatch ``b`` is the next ``W·N`` windows and rank ``r`` takes its ``r``-th N-slice (every
rank reads the whole stream). An epoch holds ``⌊S / (W·N)⌋`` superbatches, ``S`` the stream's
windows, counted by one tokenizing pass cached beside the token cache (``<key>.stream.json``):
Lightning then knows the epoch's length and does not read ahead. :meth:`state_dict` holds the stream
position: documents read, the partly packed tail, the buffer's windows and the generator's state,
so a resumed run continues with the superbatches the uninterrupted run would have drawn next.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from selection_callbacks.core.io import atomic_path
from selection_callbacks.data.packing import source_key
from selection_callbacks.data.readers import Columns, DataSourceError, Document, stream_documents

__all__ = ["DEFAULT_BUFFER", "StreamCount", "StreamingSuperbatchLoader", "count_stream"]

DEFAULT_BUFFER = 1024


@dataclass(frozen=True)
class StreamCount:
    """What one pass over a stream finds: its token total, windows S = ⌊(tokens − 1)/T⌋ and domains in first-seen order."""

    tokens: int
    windows: int
    domain_names: list[str]


def _encode(tokenizer: Any, doc: Document) -> tuple[np.ndarray, np.ndarray | None]:
    if getattr(tokenizer, "per_token_bytes", False):
        return tokenizer.encode_document_with_bytes(doc.text)
    return tokenizer.encode_document(doc.text), None


def count_stream(path: str | Path, seq_len: int, tokenizer: Any, cache_dir: str | Path, columns: Columns = Columns(),
                 name: str = "pool") -> StreamCount:
    """Tokenize the stream once (cached as ``cache_dir/<key>.stream.json``) and count its windows and domains."""
    file = Path(cache_dir) / f"{source_key(path, seq_len, tokenizer, None, columns)}.stream.json"
    if file.exists():
        return StreamCount(**json.loads(file.read_text()))
    tokens, domains = 0, {}
    for doc in stream_documents(path, columns):
        tokens += _encode(tokenizer, doc)[0].size
        domains.setdefault(doc.domain, len(domains))
    if tokens < seq_len + 1:
        raise DataSourceError(
            f"{name} stream {str(path)!r} has {tokens} tokens, fewer than one sequence of seq_len+1={seq_len + 1}; "
            "add text or lower data.seq_len"
        )
    count = StreamCount(tokens=tokens, windows=(tokens - 1) // seq_len, domain_names=list(domains))
    file.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(file, ".json") as tmp:
        tmp.write_text(json.dumps(count.__dict__))
    return count


@dataclass
class _Window:
    sample_id: int
    tokens: np.ndarray  # [T+1]
    domain: int
    nbytes: np.ndarray | None  # [T+1] or None


@dataclass
class _StreamState:
    """One epoch's position in the stream: documents read, the unpacked tail, the buffer and the generator."""

    rng: np.random.Generator
    docs_read: int = 0
    next_window: int = 0
    tail_tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    tail_domain: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    tail_bytes: np.ndarray | None = None
    buffer: list[_Window] = field(default_factory=list)
    ended: bool = False


class StreamingSuperbatchLoader:
    """Yields superbatches of ``superbatch_size`` windows per rank from a streamed source (module docstring).

    Example::

        loader = StreamingSuperbatchLoader("data/pool_saved", tokenizer, seq_len=128, superbatch_size=32,
                                           cache_dir=".cache", seed=0)

    Args:
        path: a source :func:`~selection_callbacks.data.readers.stream_documents` reads.
        tokenizer: :class:`~selection_callbacks.data.tokenizer.ByteTokenizer` or
            :class:`~selection_callbacks.data.hf_tokenizer.HFTokenizer`.
        seq_len: T.
        superbatch_size: N per rank.
        cache_dir: where the window count is cached.
        seed: order seed.
        buffer_size: windows held by the shuffle buffer.
        columns: row fields read.
        rank, world_size: this process's shard.
    """

    def __init__(self, path: str | Path, tokenizer: Any, seq_len: int, superbatch_size: int, cache_dir: str | Path,
                 seed: int = 0, buffer_size: int = DEFAULT_BUFFER, columns: Columns = Columns(), rank: int = 0,
                 world_size: int = 1) -> None:
        if buffer_size < 1:
            raise ValueError(f"shuffle buffer_size must be ≥ 1 window, got {buffer_size}")
        self.path, self.tokenizer, self.seq_len = path, tokenizer, seq_len
        self.superbatch_size, self.seed, self.buffer_size, self.columns = superbatch_size, seed, buffer_size, columns
        self.rank, self.world_size = rank, world_size
        self.per_token_bytes = bool(getattr(tokenizer, "per_token_bytes", False))
        self.count = count_stream(path, seq_len, tokenizer, cache_dir, columns)
        self.domain_codes = {d: i for i, d in enumerate(self.count.domain_names)}
        self.epoch = 0
        self.position = 0
        self._state: _StreamState | None = None
        self._docs: Iterator[Document] | None = None
        if len(self) == 0:
            raise ValueError(
                f"the stream has {self.count.windows} sequences, fewer than one global superbatch of "
                f"{superbatch_size}×{world_size}; add data or lower data.batch_size / raise data.ratio"
            )

    def __len__(self) -> int:
        return self.count.windows // (self.superbatch_size * self.world_size)

    def _fresh_state(self) -> _StreamState:
        state = _StreamState(rng=np.random.default_rng([self.seed, self.epoch]))
        if self.per_token_bytes:
            state.tail_bytes = np.zeros(0, dtype=np.int64)
        return state

    def _read_document(self, state: _StreamState) -> bool:
        """Append the next document's tokens to the tail; False at the end of the stream."""
        if self._docs is None:
            self._docs = stream_documents(self.path, self.columns, skip=state.docs_read)
        doc = next(self._docs, None)
        if doc is None:
            return False
        ids, nbytes = _encode(self.tokenizer, doc)
        state.docs_read += 1
        state.tail_tokens = np.concatenate([state.tail_tokens, ids.astype(np.int64)])
        state.tail_domain = np.concatenate([state.tail_domain, np.full(ids.size, self.domain_codes[doc.domain])])
        if state.tail_bytes is not None:
            state.tail_bytes = np.concatenate([state.tail_bytes, nbytes])
        return True

    def _pack_window(self, state: _StreamState) -> _Window | None:
        """Window ``next_window`` of the source-order stream, or None when fewer than T+1 tokens remain."""
        T = self.seq_len
        while state.tail_tokens.size < T + 1:
            if not self._read_document(state):
                return None
        labels_domain = state.tail_domain[1 : T + 1]
        window = _Window(
            sample_id=state.next_window,
            tokens=state.tail_tokens[: T + 1].copy(),
            domain=int(np.bincount(labels_domain).argmax()),  # majority over label tokens, ties → lowest code
            nbytes=None if state.tail_bytes is None else state.tail_bytes[: T + 1].copy(),
        )
        state.next_window += 1
        state.tail_tokens, state.tail_domain = state.tail_tokens[T:], state.tail_domain[T:]
        if state.tail_bytes is not None:
            state.tail_bytes = state.tail_bytes[T:]
        return window

    def _next_window(self, state: _StreamState) -> _Window:
        """Fill the buffer, then draw one window out of it uniformly."""
        while not state.ended and len(state.buffer) < self.buffer_size:
            window = self._pack_window(state)
            if window is None:
                state.ended = True
            else:
                state.buffer.append(window)
        j = int(state.rng.integers(len(state.buffer)))
        state.buffer[j], state.buffer[-1] = state.buffer[-1], state.buffer[j]
        return state.buffer.pop()

    def _batch(self, windows: list[_Window]) -> dict[str, torch.Tensor]:
        """The superbatch contract of :meth:`PackedSplit.batch` for this rank's windows."""
        tokens = torch.from_numpy(np.stack([w.tokens for w in windows]))
        out = {
            "input_ids": tokens[:, :-1].contiguous(),
            "labels": tokens[:, 1:].contiguous(),
            "sample_id": torch.tensor([w.sample_id for w in windows], dtype=torch.long),
            "domain": torch.tensor([w.domain for w in windows], dtype=torch.long),
        }
        if self.per_token_bytes:
            out["label_bytes"] = torch.from_numpy(np.stack([w.nbytes[1:] for w in windows]).astype(np.int64))
        return out

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        if self.position >= len(self):
            self.epoch, self.position, self._state = self.epoch + 1, 0, None
        if self._state is None:
            if self.position:
                raise RuntimeError("a streamed epoch cannot restart mid-way without its stream state; load a checkpoint")
            self._state, self._docs = self._fresh_state(), None
        state, n = self._state, self.superbatch_size
        while self.position < len(self):
            windows = [self._next_window(state) for _ in range(n * self.world_size)]
            self.position += 1
            yield self._batch(windows[self.rank * n : (self.rank + 1) * n])
        self.epoch, self.position, self._state, self._docs = self.epoch + 1, 0, None, None

    def state_dict(self) -> dict[str, Any]:
        """Epoch, superbatches consumed and the stream position (tensors, so checkpoints load with ``weights_only``)."""
        out: dict[str, Any] = {"epoch": self.epoch, "position": self.position, "seed": self.seed,
                               "buffer_size": self.buffer_size, "stream": None}
        s = self._state
        if s is not None:
            buf = s.buffer
            out["stream"] = {
                "rng": json.dumps(s.rng.bit_generator.state),
                "docs_read": s.docs_read,
                "next_window": s.next_window,
                "ended": s.ended,
                "tail_tokens": torch.from_numpy(s.tail_tokens.copy()),
                "tail_domain": torch.from_numpy(s.tail_domain.copy()),
                "tail_bytes": None if s.tail_bytes is None else torch.from_numpy(s.tail_bytes.copy()),
                "buffer_ids": torch.tensor([w.sample_id for w in buf], dtype=torch.long),
                "buffer_tokens": torch.from_numpy(np.stack([w.tokens for w in buf]) if buf else np.zeros((0, 0), np.int64)),
                "buffer_domain": torch.tensor([w.domain for w in buf], dtype=torch.long),
                "buffer_bytes": (torch.from_numpy(np.stack([w.nbytes for w in buf]))
                                 if buf and self.per_token_bytes else None),
            }
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("seed", "buffer_size"):
            if state.get(key, getattr(self, key)) != getattr(self, key):
                raise ValueError(f"checkpoint stream {key} {state[key]} differs from this run's {getattr(self, key)} "
                                 f"(data.{'seed' if key == 'seed' else 'shuffle_buffer'})")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._state, self._docs = None, None
        s = state.get("stream")
        if s is None:
            return
        rng = np.random.default_rng()
        rng.bit_generator.state = json.loads(s["rng"])
        ids, doms = s["buffer_ids"].tolist(), s["buffer_domain"].tolist()
        tokens = s["buffer_tokens"].numpy()
        nbytes = None if s["buffer_bytes"] is None else s["buffer_bytes"].numpy()
        self._state = _StreamState(
            rng=rng,
            docs_read=int(s["docs_read"]),
            next_window=int(s["next_window"]),
            tail_tokens=s["tail_tokens"].numpy().copy(),
            tail_domain=s["tail_domain"].numpy().copy(),
            tail_bytes=None if s["tail_bytes"] is None else s["tail_bytes"].numpy().copy(),
            buffer=[_Window(i, tokens[k].copy(), d, None if nbytes is None else nbytes[k].copy())
                    for k, (i, d) in enumerate(zip(ids, doms))],
            ended=bool(s["ended"]),
        )
