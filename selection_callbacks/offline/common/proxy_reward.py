"""Proxy feedback for offline search: the target loss of a fresh proxy trained on a subset.

R(S) = −(mean nats per byte token of the target split) of a proxy GPT trained from scratch on the
documents of S (packed in pool order) for a fixed token budget; bits per byte are −R / ln 2.
The learned policy (REINFORCE rewards) and AutoData (trial scores) both stand on it.

Example::

    with ProxyReward(pool, target, ProxyConfig(), tokens=1 << 20, windows=None, workers=2) as reward:
        r = reward([subset_a, subset_b], seeds=[0, 0])      # common random numbers: same proxy seed
"""

from __future__ import annotations

import multiprocessing as mp
import sys
import time
from concurrent.futures import ProcessPoolExecutor

import numpy as np
import torch

from selection_callbacks.offline.common.corpus import Corpus
from selection_callbacks.offline.common.proxy_train import (
    ProxyConfig,
    TokenStream,
    pack_documents,
    target_loss,
    train_proxy,
)

__all__ = ["ProxyReward"]


class _Rollouts:
    """What one rollout needs: the pool as one token stream, the target stream and the settings."""

    def __init__(self, pool: Corpus, target: Corpus, proxy: ProxyConfig, tokens: int, windows: int | None) -> None:
        self.pool_tokens = np.concatenate([pool.tokens(i) for i in range(len(pool))])
        self.starts = np.concatenate([[0], np.cumsum(pool.n_tokens)[:-1]])
        self.n_tokens = pool.n_tokens
        target_docs = [target.tokens(i) for i in range(len(target))]
        self.target: TokenStream = pack_documents(target_docs, proxy.seq_len, target.tokenizer)
        self.tokenizer = pool.tokenizer
        self.proxy, self.tokens, self.windows = proxy, tokens, windows

    def reward(self, subset: np.ndarray, seed: int) -> float:
        """−target loss of a fresh proxy trained on ``subset`` (packed in pool order)."""
        docs = [self.pool_tokens[self.starts[i] : self.starts[i] + self.n_tokens[i]] for i in np.sort(subset)]
        stream = pack_documents(docs, self.proxy.seq_len, self.tokenizer)
        model = train_proxy(stream, self.proxy, seed, self.tokens).model
        return -target_loss(model, self.target, self.windows)


_WORKER: _Rollouts | None = None


def _init_worker(rollouts: _Rollouts) -> None:
    global _WORKER
    torch.set_num_threads(1)
    _WORKER = rollouts


def _worker_reward(subset: np.ndarray, seed: int) -> float:
    return _WORKER.reward(subset, seed)


class ProxyReward:
    """R(S) = −target loss of a fresh proxy trained on S; rollouts in ``workers`` processes.

    Every rollout runs on one torch thread, in this process or a worker, so rewards do not depend
    on ``workers``. Workers are forked on Linux (no re-import; one thread each, like DataLoader
    workers, which keeps OpenMP safe after fork) and spawned elsewhere. Use as a context manager
    so the workers are shut down.

    Args:
        pool: the documents subsets index into.
        target: the split the reward is measured on (never val).
        proxy: shape and optimiser of the fresh proxies.
        tokens: training tokens per rollout.
        windows: evenly spaced target windows scored; None = all.
        workers: parallel rollout processes (1 = in this process).
    """

    def __init__(
        self, pool: Corpus, target: Corpus, proxy: ProxyConfig, tokens: int, windows: int | None, workers: int = 1
    ) -> None:
        if workers < 1:
            raise ValueError(f"workers must be ≥ 1, got {workers}")
        self.rollouts = _Rollouts(pool, target, proxy, tokens, windows)
        self.executor = None
        if workers > 1:
            method = "fork" if sys.platform.startswith("linux") else "spawn"
            self.executor = ProcessPoolExecutor(
                workers, mp_context=mp.get_context(method), initializer=_init_worker, initargs=(self.rollouts,)
            )
        self.count, self.seconds = 0, 0.0

    def __call__(self, subsets: list[np.ndarray], seeds: list[int]) -> np.ndarray:
        start = time.perf_counter()
        if self.executor is None:
            threads = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                out = [self.rollouts.reward(s, seed) for s, seed in zip(subsets, seeds)]
            finally:
                torch.set_num_threads(threads)
        else:
            out = list(self.executor.map(_worker_reward, subsets, seeds))
        self.count += len(subsets)
        self.seconds += time.perf_counter() - start
        return np.asarray(out)

    def __enter__(self) -> ProxyReward:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.executor is not None:
            self.executor.shutdown()
