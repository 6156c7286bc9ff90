"""The feature bank: one row of cheap and proxy-based features per pool document, cached per pool.

Columns (D rows, in pool order):

- ``n_bytes``, ``n_tokens``: UTF-8 bytes; ByteTokenizer tokens (bytes + 1 BOS).
- ``distinct_1`` … ``distinct_5``: distinct / total whitespace-word n-grams (1 when a document has
  fewer than n words): low values mean repetition.
- ``non_ascii``: share of bytes ≥ 128.
- ``byte_entropy``: −Σ p log₂ p of the document's byte histogram (bits).
- ``bos_per_seq``: T / n_tokens, boundary (BOS) tokens per training window of T tokens that the
  document brings when packed (a length transform; the report's "BOS count" per sequence).
- ``log_freq``: mean over the document's bytes of log p_pool(byte), the pool's smoothed unigram.
- ``loss_early``, ``loss_final``, ``bpb_early``, ``bpb_final``: a proxy GPT trained one pass over a
  sample of the pool that every document contributes to alike: its first q tokens, q set so the
  sample holds ``proxy_tokens`` tokens (:func:`prefix_quota`; windows in an order seeded by
  ``seed``; the whole pool when the budget covers it or is None). Scored by forward passes at
  ``early_fraction`` of its steps and at the end (nats per byte, bits per byte; the first
  ``score_tokens`` tokens of every document); ``delta`` = loss_early − loss_final, the
  warmup-delta score.
- ``grad_align``: cosine of the document's output-head gradient with the target's mean
  output-head gradient under the final proxy (see :func:`proxy_train.score_documents`).
- ``dsir``: DSIR log importance to the target per n-gram (length-normalised log w).
- ``cluster``: k-means label of the document's embedding (a topic stand-in; categorical).

Everything is computed once per (pool file, target file, settings) and cached as ``.npz`` under
``<cache_dir>/features/``; the proxy and k-means use ``FeatureConfig.seed``, not the selection seed,
so one bank serves every seed of a benchmark. Computing a bank prints its proxy sample and the
seconds and peak memory of each stage; both are kept in ``meta`` (``proxy_sample``, ``costs``).

The proxy's cost is bounded by ``proxy_tokens`` (training) and ``score_tokens`` × documents
(scoring, forward only), not by the pool's size. The default budget, 8M tokens (1,954 steps of
32 × 128), is one full pass on pools up to 8M tokens and a sample of every document's prefix
beyond; lower it to bound the bank's cost on a larger pool, knowing warmup delta's ranking moves
with it (:mod:`selection_callbacks.offline.warmup_delta.selector`).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from selection_callbacks.core.costs import StageCosts
from selection_callbacks.core.io import atomic_path
from selection_callbacks.data.cache import default_cache_dir
from selection_callbacks.data.readers import source_files
from selection_callbacks.offline.common.corpus import Corpus
from selection_callbacks.offline.common.embeddings import make_embedder
from selection_callbacks.offline.common.proxy_train import ProxyConfig, pack_documents, train_proxy
from selection_callbacks.offline.dsir.selector import DSIRConfig, log_importance

FEATURE_VERSION = 3
DEFAULT_PROXY_TOKENS = 8_000_000
NGRAM_ORDERS = (1, 2, 3, 4, 5)
NUMERIC_FEATURES = (
    "n_bytes", "n_tokens", *(f"distinct_{n}" for n in NGRAM_ORDERS), "non_ascii", "byte_entropy", "bos_per_seq",
    "log_freq", "loss_early", "loss_final", "bpb_early", "bpb_final", "delta", "grad_align", "dsir",
)


@dataclass
class FeatureConfig:
    """How the feature bank is computed.

    Attributes:
        proxy: the proxy GPT trained on a sample of the pool (shared with warmup delta).
        proxy_tokens: tokens the proxy trains on: one pass over every document's first q tokens, q
            water-filled so the total meets the budget (:func:`prefix_quota`); None (or a budget
            past the pool, as the default is on the default corpus) = one pass over the whole pool.
        early_fraction: the early checkpoint, as a fraction of the proxy's steps (the report: 10%).
        score_tokens: tokens of each document (its first ones) the proxy scores; None = all.
        dsir: hashed n-gram settings of the ``dsir`` column.
        clusters: k of the embedding k-means.
        embedder: ``hashed`` (fast), ``minilm`` or ``auto`` (MiniLM when installed: slow on CPU).
        seed: seed of the proxy and the k-means.
    """

    proxy: ProxyConfig = field(default_factory=ProxyConfig)
    proxy_tokens: int | None = DEFAULT_PROXY_TOKENS
    early_fraction: float = 0.1
    score_tokens: int | None = 1024
    dsir: DSIRConfig = field(default_factory=DSIRConfig)
    clusters: int = 8
    embedder: str = "hashed"
    seed: int = 0


@dataclass
class FeatureBank:
    """Per-document features of a pool.

    Attributes:
        ids: str [D] document ids, pool order.
        domains: str [D].
        columns: name → array [D] (float64; ``cluster`` int64).
        meta: how it was made (settings, embedder, seconds).
    """

    ids: np.ndarray
    domains: np.ndarray
    columns: dict[str, np.ndarray]
    meta: dict

    @property
    def names(self) -> list[str]:
        return list(self.columns)

    def matrix(self, names: list[str] | tuple[str, ...]) -> np.ndarray:
        """float64 [D, F] of the named columns."""
        unknown = [n for n in names if n not in self.columns]
        if unknown:
            raise KeyError(f"unknown feature(s) {unknown}; the bank has {self.names}")
        return np.stack([self.columns[n].astype(np.float64) for n in names], axis=1)

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(path, ".npz") as tmp:
            np.savez(tmp, ids=self.ids, domains=self.domains, meta=json.dumps(self.meta), **self.columns)

    @classmethod
    def load(cls, path: Path) -> FeatureBank:
        with np.load(path) as z:
            columns = {k: z[k] for k in z.files if k not in ("ids", "domains", "meta")}
            return cls(ids=z["ids"], domains=z["domains"], columns=columns, meta=json.loads(str(z["meta"])))


def bank_key(pool: Corpus, target: Corpus, cfg: FeatureConfig) -> str:
    """sha256 of the feature version, pool and target files (path, size, mtime) and the settings."""
    h = hashlib.sha256(f"features-v{FEATURE_VERSION}|{json.dumps(asdict(cfg), sort_keys=True)}".encode())
    for split in (pool, target):
        for f in source_files(split.path):
            st = f.stat()
            h.update(f"|{f.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode())
    return h.hexdigest()[:20]


def feature_bank(
    pool: Corpus, target: Corpus, cfg: FeatureConfig, cache_dir: str | Path | None = None, progress: bool = True
) -> FeatureBank:
    """The cached bank for (pool, target, cfg), computing it on a miss."""
    path = Path(cache_dir or default_cache_dir()) / "features" / f"{bank_key(pool, target, cfg)}.npz"
    if path.exists():
        bank = FeatureBank.load(path)
        if np.array_equal(bank.ids, pool.ids):
            return bank
    bank = compute_features(pool, target, cfg, progress)
    bank.save(path)
    return bank


def compute_features(pool: Corpus, target: Corpus, cfg: FeatureConfig, progress: bool = True) -> FeatureBank:
    """Every column of the module docstring, uncached; prints the proxy sample and the cost per stage."""
    costs = StageCosts()
    with costs.stage("text"):
        cols = text_features(pool, cfg.proxy.seq_len, progress)
    proxy_cols, sample = proxy_features(pool, target, cfg, costs, progress)
    cols.update(proxy_cols)
    with costs.stage("dsir"):
        logw, count = log_importance(pool, target, cfg.dsir, progress)
        cols["dsir"] = logw / np.maximum(count, 1)
    with costs.stage("embed"):
        embedder = make_embedder(cfg.embedder)
        emb = embedder.embed(pool.texts)
    with costs.stage("kmeans"):
        cols["cluster"] = kmeans(emb, cfg.clusters, cfg.seed)
    print(f"[feature bank] {len(pool)} documents; proxy trained one pass over their first "
          f"{sample['tokens_per_document']:,} tokens ({sample['tokens']:,} tokens, {sample['share']:.1%} of the pool, "
          f"{sample['whole_documents']} documents whole; window order seed {sample['seed']}), "
          f"scored {sample['scored_tokens']:,} tokens per checkpoint", flush=True)
    print(costs.table("feature bank"), flush=True)
    meta = {"config": asdict(cfg), "embedder": embedder.name, "seconds": costs.seconds, "proxy_sample": sample,
            "costs": costs.as_dict()}
    return FeatureBank(ids=pool.ids, domains=pool.domains, columns=cols, meta=meta)


def distinct_ratio(words: list[str], n: int) -> float:
    """|distinct n-grams| / |n-grams| of a word list; 1 when there is no n-gram."""
    total = len(words) - n + 1
    if total < 1:
        return 1.0
    return len(set(zip(*(words[i:] for i in range(n))))) / total


def text_features(pool: Corpus, seq_len: int, progress: bool = True) -> dict[str, np.ndarray]:
    """Length, distinct n-gram ratios, non-ASCII share, byte entropy, BOS per window, log frequency."""
    D = len(pool)
    byte_counts = np.zeros((D, 256))
    distinct = np.zeros((D, len(NGRAM_ORDERS)))
    for i, text in enumerate(tqdm(pool.texts, desc="features: text", unit="doc", disable=not progress)):
        byte_counts[i] = byte_histogram(text)
        distinct[i] = distinct_ratios(text)
    by_bytes = byte_columns(byte_counts)
    cols = {"n_bytes": by_bytes["n_bytes"], "n_tokens": pool.n_tokens.astype(np.float64)}
    cols.update({f"distinct_{n}": distinct[:, j] for j, n in enumerate(NGRAM_ORDERS)})
    cols["non_ascii"] = by_bytes["non_ascii"]
    cols["byte_entropy"] = by_bytes["byte_entropy"]
    cols["bos_per_seq"] = seq_len / pool.n_tokens
    cols["log_freq"] = log_frequency(byte_counts, byte_log_probs(byte_counts.sum(0)))
    return cols


def byte_histogram(text: str) -> np.ndarray:
    """int64 [256]: counts of the document's UTF-8 bytes."""
    return np.bincount(np.frombuffer(text.encode("utf-8", errors="replace"), np.uint8), minlength=256)


def distinct_ratios(text: str) -> list[float]:
    """:func:`distinct_ratio` of the document's whitespace words for n in NGRAM_ORDERS."""
    words = text.split()
    return [distinct_ratio(words, n) for n in NGRAM_ORDERS]


def byte_columns(byte_counts: np.ndarray) -> dict[str, np.ndarray]:
    """``n_bytes``, ``non_ascii`` (share of bytes ≥ 128) and ``byte_entropy`` (bits) [n] of byte histograms [n, 256]."""
    n_bytes = byte_counts.sum(1)
    safe = np.maximum(n_bytes, 1)[:, None]
    p = byte_counts / safe
    with np.errstate(divide="ignore", invalid="ignore"):
        entropy = -np.where(p > 0, p * np.log2(p), 0.0).sum(1)
    return {"n_bytes": n_bytes, "non_ascii": byte_counts[:, 128:].sum(1) / safe[:, 0], "byte_entropy": entropy}


def log_frequency(byte_counts: np.ndarray, byte_logp: np.ndarray) -> np.ndarray:
    """``log_freq`` [n]: the mean over a document's bytes of log p_pool(byte), from histograms [n, 256]."""
    return (byte_counts @ byte_logp) / np.maximum(byte_counts.sum(1), 1)


def byte_log_probs(totals: np.ndarray) -> np.ndarray:
    """float64 [256]: log p_pool(byte), the pool's byte histogram ``totals`` [256] smoothed by one count each."""
    totals = np.asarray(totals, dtype=np.float64)
    return np.log((totals + 1.0) / (totals.sum() + 256.0))


def prefix_quota(lengths: np.ndarray, budget: int | None) -> int:
    """q, the most tokens taken from the start of each document with Σ_d min(len_d, q) ≤ budget.

    Water-filling over documents: short documents come whole, long ones give their first q tokens,
    so every document gives the proxy the same kind of sample. None (or a budget covering the pool)
    gives the longest length: every document whole, one pass over the pool.
    """
    lengths = np.sort(np.asarray(lengths, dtype=np.int64))
    if budget is None or budget >= lengths.sum():
        return int(lengths[-1])
    if budget < 2 * lengths.size:
        raise ValueError(f"proxy_tokens={budget} gives fewer than 2 tokens to each of the {lengths.size} documents; "
                         "raise it (or None for one pass over the pool)")
    below = np.concatenate([[0], np.cumsum(lengths)])  # tokens of the i shortest documents
    for i, n in enumerate(lengths):  # the i shortest come whole; the rest share what is left
        q = (budget - below[i]) // (lengths.size - i)
        if q < n:
            return int(q)
    return int(lengths[-1])


def proxy_features(
    pool: Corpus, target: Corpus, cfg: FeatureConfig, costs: StageCosts | None = None, progress: bool = True
) -> tuple[dict[str, np.ndarray], dict]:
    """Losses and bpb at the early and final checkpoints, their delta and the gradient alignment; the sample.

    The proxy trains one pass over every document's first q tokens (:func:`prefix_quota` of
    ``proxy_tokens``; windows in an order seeded by ``cfg.seed``) and scores every document's first
    ``score_tokens`` tokens at both checkpoints (forward passes only). Every document gives the
    same kind of sample, so no document's scores differ by whether it happened to be drawn: with a
    uniform sample of windows, drawn documents would score as memorised and the others as held
    out, and that split alone would move the subsets the bank's features select. The second value
    says what the proxy saw.
    """
    if not 0.0 < cfg.early_fraction < 1.0:
        raise ValueError(f"early_fraction must lie in (0, 1), got {cfg.early_fraction}")
    if cfg.proxy_tokens is not None and cfg.proxy_tokens < 1:
        raise ValueError(f"proxy_tokens must be ≥ 1 (or None for one pass over the pool), got {cfg.proxy_tokens}")
    costs = costs or StageCosts()
    T = cfg.proxy.seq_len
    with costs.stage("pack"):
        docs = [pool.tokens(i) for i in range(len(pool))]
        lengths = np.asarray(pool.n_tokens, dtype=np.int64)
        quota = prefix_quota(lengths, cfg.proxy_tokens)
        cap = cfg.score_tokens
        score_on = pack_documents(docs if cap is None else [d[:cap] for d in docs], T, pool.tokenizer)
        train = pack_documents([d[:quota] for d in docs], T, pool.tokenizer)
        del docs
        align_with = pack_documents([target.tokens(i) for i in range(len(target))], T, target.tokenizer)
    with costs.stage("proxy"):
        run = train_proxy(
            train, cfg.proxy, cfg.seed, None, checkpoints=(cfg.early_fraction, 1.0), score_on=score_on,
            align_with=align_with, progress=progress, desc="features: proxy on the pool's document prefixes",
        )
    costs.stages["proxy"].update({f"{k}_seconds": v for k, v in run.seconds.items()})
    early, final = run.scores[cfg.early_fraction], run.scores[1.0]
    sample = {
        "tokens": int(train.tokens.size), "pool_tokens": int(lengths.sum()), "share": train.tokens.size / lengths.sum(),
        "tokens_per_document": quota, "whole_documents": int((lengths <= quota).sum()), "steps": run.steps,
        "seed": cfg.seed, "draw": "every document's first tokens_per_document tokens, one pass, windows in a seeded order",
        "scored_tokens": int(score_on.tokens.size),
    }
    cols = {
        "loss_early": early.loss, "loss_final": final.loss, "bpb_early": early.bpb, "bpb_final": final.bpb,
        "delta": early.loss - final.loss, "grad_align": final.grad_align,
    }
    return cols, sample


def kmeans(x: np.ndarray, k: int, seed: int, iters: int = 50) -> np.ndarray:
    """Lloyd's k-means with k-means++ seeding; int64 labels [n] (k capped at n)."""
    x = np.asarray(x, dtype=np.float64)
    n = x.shape[0]
    k = max(1, min(k, n))
    rng = np.random.default_rng([seed, 0xC1])
    centres = [x[rng.integers(n)]]
    d2 = ((x - centres[0]) ** 2).sum(1)
    for _ in range(1, k):
        probs = d2 / d2.sum() if d2.sum() > 0 else np.full(n, 1.0 / n)
        centres.append(x[rng.choice(n, p=probs)])
        d2 = np.minimum(d2, ((x - centres[-1]) ** 2).sum(1))
    c = np.stack(centres)
    labels = np.full(n, -1)
    for _ in range(iters):
        dist = (x**2).sum(1)[:, None] - 2 * x @ c.T + (c**2).sum(1)[None, :]
        new = dist.argmin(1)
        if np.array_equal(new, labels):
            break
        labels = new
        for j in range(k):
            if (labels == j).any():
                c[j] = x[labels == j].mean(0)
    return labels.astype(np.int64)


def standardised_columns(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(z, mean, std) per column: z = (x − mean) / std (std 0 → 1); NaN entries become 0 (the column mean)."""
    mean = np.nanmean(x, axis=0)
    std = np.nanstd(x, axis=0)
    std = np.where(np.isfinite(std) & (std > 0), std, 1.0)
    mean = np.where(np.isfinite(mean), mean, 0.0)
    return np.nan_to_num((x - mean) / std, nan=0.0), mean, std

