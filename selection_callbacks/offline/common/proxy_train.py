"""Train a small GPT proxy on packed documents; score documents and a target split with it.

Documents are packed like the pool datamodule packs them (``[BOS] + tokens`` back to back; window
``s`` is ``stream[s·T : s·T + T + 1]``). The proxy is the plugin's GPT built by
:mod:`selection_callbacks.scoring.proxy_models` over the vocabulary of the tokenizer the stream was
packed with (:func:`make_proxy`). Training draws whole windows in a seeded order, so a run is a
function of (documents, config, seed, token budget). Scoring covers every label position once (the
last window padded and masked) and credits each prediction to the document its label belongs to;
predictions of a boundary token are left out, so a document's loss is its mean nats per token and
its ``bpb`` is that over ln 2: bits per byte for the corpus' byte tokens
(:class:`~selection_callbacks.data.tokenizer.ByteTokenizer`).

Example::

    stream = pack_documents([pool.tokens(i) for i in range(len(pool))], 128, pool.tokenizer)
    run = train_proxy(stream, ProxyConfig(), seed=0, checkpoints=(0.1, 1.0), score_on=stream)
    run.scores[0.1].loss - run.scores[1.0].loss      # warmup delta per document
    target_loss(run.model, pack_documents(target_docs, 128, target.tokenizer))
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from selection_callbacks.nn.gpt import GPT
from selection_callbacks.nn.optim import warmup_cosine
from selection_callbacks.scoring.proxy_models import gpt_proxy_config, initialised_proxy, padded_vocab

__all__ = [
    "DocScores", "ProxyConfig", "ProxyRun", "StreamTokenizer", "TokenStream", "make_proxy", "pack_documents",
    "score_documents", "target_head_gradient", "target_loss", "train_proxy",
]


class StreamTokenizer(Protocol):
    """What a stream keeps of the tokenizer its documents were encoded with (:class:`ByteTokenizer`,
    :class:`~selection_callbacks.data.hf_tokenizer.HFTokenizer`): its token ids and its boundary id."""

    vocab_size: int
    bos_id: int


@dataclass
class ProxyConfig:
    """Shape and optimisation of a proxy GPT (AdamW, linear warmup, cosine decay).

    Attributes:
        n_layer: transformer blocks.
        n_head: attention heads.
        n_embd: width.
        seq_len: T, tokens per training window.
        batch_size: windows per step.
        lr: peak AdamW learning rate.
        warmup_fraction: share of the steps spent in linear warmup.
        min_lr_ratio: final learning rate as a fraction of the peak.
        weight_decay: AdamW decoupled weight decay.
    """

    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    seq_len: int = 128
    batch_size: int = 32
    lr: float = 3e-3
    warmup_fraction: float = 0.05
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0


@dataclass
class TokenStream:
    """Documents packed back to back.

    Attributes:
        tokens: int64 [L], the stream.
        doc_start: int64 [D], offset of each document's BOS.
        seq_len: T.
        vocab_size: V, the token ids of the tokenizer the documents were encoded with (ids < V).
        bos_id: that tokenizer's document-boundary id.
    """

    tokens: np.ndarray
    doc_start: np.ndarray
    seq_len: int
    vocab_size: int
    bos_id: int

    @property
    def n_docs(self) -> int:
        return int(self.doc_start.size)

    @property
    def n_windows(self) -> int:
        """Full training windows: ⌊(L − 1)/T⌋."""
        return (self.tokens.size - 1) // self.seq_len

    @property
    def n_eval_windows(self) -> int:
        """Windows that cover every label position 1..L−1, the last one padded: ⌈(L − 1)/T⌉."""
        return -(-(self.tokens.size - 1) // self.seq_len)

    def windows(self, ids: np.ndarray) -> np.ndarray:
        """int64 [n, T+1]; positions past the stream read BOS (mask them by position)."""
        idx = np.asarray(ids, dtype=np.int64)[:, None] * self.seq_len + np.arange(self.seq_len + 1)[None, :]
        out = np.full(idx.shape, self.bos_id, dtype=np.int64)
        inside = idx < self.tokens.size
        out[inside] = self.tokens[idx[inside]]
        return out


def pack_documents(docs: Sequence[np.ndarray], seq_len: int, tokenizer: StreamTokenizer) -> TokenStream:
    """Concatenate documents ``tokenizer`` encoded (each starting with its BOS) into a :class:`TokenStream`."""
    if not docs:
        raise ValueError("no documents to pack")
    lengths = np.asarray([d.size for d in docs], dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    tokens = np.concatenate(docs).astype(np.int64)
    return TokenStream(tokens, starts, seq_len, int(tokenizer.vocab_size), int(tokenizer.bos_id))


@dataclass
class DocScores:
    """Per-document scores under one checkpoint (NaN for a document with no token besides its BOS).

    Attributes:
        loss: float64 [D], mean nats per token (per byte for byte tokens).
        bpb: float64 [D], loss / ln 2 (bits per byte for byte tokens).
        grad_align: float64 [D] or None, cosine of the document's output-head gradient with the
            target's mean output-head gradient.
    """

    loss: np.ndarray
    bpb: np.ndarray
    grad_align: np.ndarray | None = None


@dataclass
class ProxyRun:
    """A trained proxy and its document scores at the requested checkpoints.

    Attributes:
        model: the proxy after its last step.
        scores: fraction of steps → document scores at that checkpoint.
        steps: optimizer steps taken.
        windows: training windows drawn (steps · batch_size; a window may repeat only past one pass).
        seconds: ``train`` (forward, backward, step) and ``score`` (checkpoint scoring) wall seconds.
    """

    model: GPT
    scores: dict[float, DocScores]
    steps: int
    windows: int = 0
    seconds: dict[str, float] = field(default_factory=dict)


def make_proxy(cfg: ProxyConfig, vocab_size: int, seed: int) -> GPT:
    """A freshly initialised proxy GPT of ``cfg``'s shape over ``vocab_size`` token ids, initialised under
    ``torch.manual_seed(seed)``; the global torch RNG is left untouched.

    Built by :func:`~selection_callbacks.scoring.proxy_models.initialised_proxy` from
    :func:`~selection_callbacks.scoring.proxy_models.gpt_proxy_config`, the embedding rows
    :func:`~selection_callbacks.scoring.proxy_models.padded_vocab` (a multiple of 64: 320 for the
    corpus' 257 byte tokens, 4096 for a 4,096-token BPE) and the context ``cfg.seq_len``.

    Example::

        make_proxy(ProxyConfig(), pool.tokenizer.vocab_size, seed=0).config.vocab_size  # 320: 257 byte tokens
    """
    config = gpt_proxy_config(padded_vocab(vocab_size), cfg.seq_len, cfg.n_layer, cfg.n_embd, cfg.n_head)
    return initialised_proxy(config, seed).model


def train_proxy(
    train: TokenStream,
    cfg: ProxyConfig,
    seed: int,
    tokens: int | None = None,
    checkpoints: Sequence[float] = (),
    score_on: TokenStream | None = None,
    align_with: TokenStream | None = None,
    progress: bool = False,
    desc: str = "proxy",
) -> ProxyRun:
    """Train a fresh proxy for ``tokens`` training tokens (None: one pass over ``train``'s windows).

    Steps = ⌈tokens / (batch_size·T)⌉; windows are drawn in seeded random order, epoch after epoch.
    At each fraction f of ``checkpoints`` (step max(1, round(f·steps))) the documents of
    ``score_on`` are scored; at the last one also their gradient alignment to ``align_with``.
    """
    if train.seq_len != cfg.seq_len:
        raise ValueError(f"stream packed with T={train.seq_len}, proxy expects seq_len={cfg.seq_len}")
    if train.n_windows < 1:
        raise ValueError(f"{train.tokens.size} tokens are fewer than one window of seq_len+1={cfg.seq_len + 1}")
    if checkpoints and score_on is None:
        raise ValueError("checkpoints need score_on: the documents to score")
    if any(not 0.0 < f <= 1.0 for f in checkpoints):
        raise ValueError(f"checkpoints are fractions of the steps in (0, 1], got {list(checkpoints)}")
    per_step = cfg.batch_size * cfg.seq_len
    steps = max(1, math.ceil((tokens if tokens is not None else train.n_windows * cfg.seq_len) / per_step))
    at_step: dict[int, list[float]] = {}
    for f in checkpoints:
        at_step.setdefault(max(1, round(f * steps)), []).append(f)
    model = make_proxy(cfg, train.vocab_size, seed)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, warmup_cosine(max(1, round(cfg.warmup_fraction * steps)), steps, cfg.min_lr_ratio)
    )
    rng = np.random.default_rng([seed, 1])
    order = np.empty(0, dtype=np.int64)
    scores: dict[float, DocScores] = {}
    start, score_seconds = time.perf_counter(), 0.0
    for step in tqdm(range(1, steps + 1), desc=desc, unit="step", disable=not progress, leave=False):
        while order.size < cfg.batch_size:
            order = np.concatenate([order, rng.permutation(train.n_windows)])
        batch, order = order[: cfg.batch_size], order[cfg.batch_size :]
        w = torch.from_numpy(train.windows(batch))
        model.train()
        logits = model(w[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), w[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        if step in at_step:
            t = time.perf_counter()
            last = max(checkpoints) in at_step[step]
            now = score_documents(model, score_on, align_with if last else None)
            scores.update(dict.fromkeys(at_step[step], now))
            score_seconds += time.perf_counter() - t
    seconds = {"train": round(time.perf_counter() - start - score_seconds, 2), "score": round(score_seconds, 2)}
    return ProxyRun(model=model, scores=scores, steps=steps, windows=steps * cfg.batch_size, seconds=seconds)


@dataclass
class _Chunk:
    """One scoring batch, label positions in stream order: rows whose label is a token, not a boundary."""

    pos: np.ndarray  # int64 [n], stream position of each label
    nll: torch.Tensor  # [n]
    err: torch.Tensor | None  # [n, V], softmax − onehot (∂nll/∂logits)
    hidden: torch.Tensor | None  # [n, d], the output head's input


@torch.no_grad()
def _chunks(
    model: GPT, stream: TokenStream, window_ids: np.ndarray, batch_windows: int, head_grad: bool
) -> Iterator[_Chunk]:
    if stream.seq_len > model.config.block_size:
        raise ValueError(f"stream T={stream.seq_len} exceeds the proxy's block_size {model.config.block_size}")
    if stream.vocab_size > model.config.vocab_size:
        raise ValueError(
            f"the stream's tokenizer has {stream.vocab_size} token ids, the proxy's embedding "
            f"{model.config.vocab_size} rows: score with a proxy trained on a stream of the same tokenizer"
        )
    model.eval()
    captured: dict[str, torch.Tensor] = {}
    hook = model.lm_head.register_forward_hook(lambda m, inp, out: captured.__setitem__("h", inp[0]))
    T = stream.seq_len
    try:
        for i in range(0, window_ids.size, batch_windows):
            ids = window_ids[i : i + batch_windows]
            w = torch.from_numpy(stream.windows(ids))
            logits = model(w[:, :-1]).flatten(0, 1)
            if logits.dtype in (torch.float16, torch.bfloat16):
                logits = logits.float()
            labels = w[:, 1:].flatten()
            pos = (ids[:, None] * T + 1 + np.arange(T)[None, :]).ravel()
            keep = torch.from_numpy(pos < stream.tokens.size) & (labels != stream.bos_id)
            logp = torch.log_softmax(logits[keep], dim=-1)
            y = labels[keep]
            nll = -logp.gather(1, y[:, None])[:, 0]
            err = hidden = None
            if head_grad:
                err = logp.exp()
                err[torch.arange(y.numel()), y] -= 1.0
                hidden = captured["h"].flatten(0, 1)[keep].to(err.dtype)
            yield _Chunk(pos[keep.numpy()], nll, err, hidden)
    finally:
        hook.remove()


def target_head_gradient(model: GPT, target: TokenStream, batch_windows: int = 64) -> torch.Tensor:
    """Ḡ = mean over the target's token labels (boundaries left out) of (softmax − onehot)·hᵀ: the output head's
    gradient, [V, d]."""
    total, count = None, 0
    for c in _chunks(model, target, np.arange(target.n_eval_windows), batch_windows, head_grad=True):
        g = c.err.T @ c.hidden
        total = g if total is None else total + g
        count += c.pos.size
    if total is None or count == 0:
        raise ValueError("the target stream holds no token besides document boundaries")
    return total / count


def score_documents(
    model: GPT, stream: TokenStream, align_with: TokenStream | None = None, batch_windows: int = 64
) -> DocScores:
    """Per-document loss and bpb; with ``align_with``, the head-gradient cosine to the target.

    G_doc = Σ_{t ∈ doc} (softmax_t − onehot_t) h_tᵀ [V, d]; grad_align = ⟨G_doc, Ḡ⟩ / (‖G_doc‖ ‖Ḡ‖).
    Documents are contiguous in the stream, so G_doc is accumulated segment by segment and
    dropped once the document ends: memory stays O(V·d).
    """
    D = stream.n_docs
    nats, count = np.zeros(D), np.zeros(D)
    target_g = target_head_gradient(model, align_with, batch_windows) if align_with is not None else None
    dot, sq_norm = np.zeros(D), np.zeros(D)
    open_docs: dict[int, torch.Tensor] = {}
    windows = np.arange(stream.n_eval_windows)
    for c in _chunks(model, stream, windows, batch_windows, head_grad=target_g is not None):
        doc = np.searchsorted(stream.doc_start, c.pos, side="right") - 1
        nats += np.bincount(doc, weights=c.nll.double().numpy(), minlength=D)
        count += np.bincount(doc, minlength=D)
        if target_g is None or doc.size == 0:
            continue
        per_token = (c.err * (c.hidden @ target_g.T)).sum(1)
        dot += np.bincount(doc, weights=per_token.double().numpy(), minlength=D)
        cuts = np.flatnonzero(np.diff(doc)) + 1
        for a, b in zip(np.concatenate([[0], cuts]), np.concatenate([cuts, [doc.size]])):
            d = int(doc[a])
            g = c.err[a:b].T @ c.hidden[a:b]
            open_docs[d] = open_docs[d] + g if d in open_docs else g
        for d in [d for d in open_docs if d < doc[-1]]:
            sq_norm[d] = float(open_docs.pop(d).square().sum())
    for d, g in open_docs.items():
        sq_norm[d] = float(g.square().sum())
    with np.errstate(invalid="ignore", divide="ignore"):
        loss = nats / count
        align = None
        if target_g is not None:
            norm = np.sqrt(sq_norm) * float(target_g.norm())
            align = np.where(norm > 0, dot / np.where(norm > 0, norm, 1.0), 0.0)
    return DocScores(loss=loss, bpb=loss / math.log(2), grad_align=align)


def target_loss(model: GPT, target: TokenStream, max_windows: int | None = None, batch_windows: int = 64) -> float:
    """Mean nats per token of the target, per byte for byte tokens (``max_windows`` evenly spaced windows if capped)."""
    n = target.n_eval_windows
    ids = np.arange(n)
    if max_windows is not None and max_windows < n:
        ids = np.unique(np.linspace(0, n - 1, max_windows).round().astype(np.int64))
    nats, count = 0.0, 0
    for c in _chunks(model, target, ids, batch_windows, head_grad=False):
        nats += float(c.nll.double().sum())
        count += c.pos.size
    if count == 0:
        raise ValueError("the target stream holds no token besides document boundaries")
    return nats / count
