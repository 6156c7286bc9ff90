"""Sampling rules: choose K of N candidates from their scores.

Each rule returns the chosen indices and the inclusion probabilities π_i = P(i ∈ S), from
which the effective sample size of the selection is ESS = (Σπ)² / Σπ² = K² / Σπ²: K for a
deterministic top-K, N for uniform sampling.

Gumbel-top-k is defined once, here, for the rules and for the offline selectors: :func:`gumbel_noise`
(torch tensors) and :func:`gumbel_keys` / :func:`gumbel_order` (numpy arrays).
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch

__all__ = [
    "GumbelTopK", "SamplingRule", "SequentialBoltzmann", "TopK", "Uniform", "effective_sample_size", "gumbel_keys",
    "gumbel_noise", "gumbel_order", "make_rule",
]

_NUMPY_FLOATS = {torch.float32: np.float32, torch.float64: np.float64}


def gumbel_noise(
    shape: tuple[int, ...], generator: torch.Generator | np.random.Generator, dtype: torch.dtype = torch.float64
) -> torch.Tensor:
    """Standard Gumbel noise G = −log E, E ~ Exp(1) i.i.d., as a torch tensor of ``shape`` and ``dtype``.

    Adding G to scores and taking the K largest keys is Gumbel-top-K: a sample of K without
    replacement ∝ exp(score) (Plackett–Luce). The exponentials come from ``generator``:

    - a ``torch.Generator``: E = −log U with U ~ U(0, 1) drawn in float64 and clamped to
      [1e-12, 1 − 1e-12] (so G is finite); G is cast to ``dtype`` at the end;
    - a ``numpy.random.Generator``: E = ``standard_exponential(shape, dtype)`` (float32 or float64),
      so float32 noise never passes through float64 (half the memory of a large key matrix).

    The numpy sites that return numpy arrays use :func:`gumbel_keys` instead: ``rng.gumbel`` draws
    its own stream with numpy's ``log``, which no torch computation reproduces bit for bit.
    """
    if isinstance(generator, np.random.Generator):
        e = torch.from_numpy(generator.standard_exponential(shape, dtype=_NUMPY_FLOATS[dtype]))
        return e.log_().neg_()
    u = torch.rand(shape, generator=generator, dtype=torch.float64).clamp_(1e-12, 1 - 1e-12)
    return (-torch.log(-torch.log(u))).to(dtype)


def gumbel_keys(
    scores: np.ndarray, rng: np.random.Generator, temperature: float = 1.0, *, scale_noise: bool = False
) -> np.ndarray:
    """Gumbel-top-k keys of ``scores`` (float64, any shape): their descending order is a Plackett–Luce
    sample without replacement ∝ exp(scores / τ).

    The keys are ``scores / τ + G``, or with ``scale_noise`` ``scores + τ·G`` (the same order in exact
    arithmetic, rounded differently, and defined at τ = 0, where the keys are the scores), with
    G ~ Gumbel(0, 1) i.i.d. from ``rng.gumbel`` in the shape of ``scores``. τ = 1 gives exactly
    ``scores + G`` either way.
    """
    s = np.asarray(scores, dtype=np.float64)
    g = rng.gumbel(size=s.shape)
    return s + temperature * g if scale_noise else s / temperature + g


def gumbel_order(
    scores: np.ndarray, rng: np.random.Generator, temperature: float = 1.0, *, scale_noise: bool = False
) -> np.ndarray:
    """Indices of 1-d ``scores`` by descending :func:`gumbel_keys` (stable: ties to the lower index).

    Every prefix is a sample without replacement with probabilities ∝ exp(scores / τ); ``-inf``
    scores come last.
    """
    return np.argsort(-gumbel_keys(scores, rng, temperature, scale_noise=scale_noise), kind="stable")


class SamplingRule(Protocol):
    def select(
        self, scores: torch.Tensor, k: int, generator: torch.Generator, interactions: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Indices [k] into ``scores`` [N] (float, CPU); ``interactions`` [N, N] if the rule uses them."""
        ...

    def inclusion(
        self, scores: torch.Tensor, k: int, generator: torch.Generator, interactions: torch.Tensor | None = None
    ) -> torch.Tensor:
        """π [N], the probability that each candidate is chosen."""
        ...


def _top(keys: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest keys; ties go to the lower index (stable, deterministic)."""
    return torch.sort(keys, descending=True, stable=True).indices[:k]


class TopK:
    """The K highest scores."""

    def select(self, scores: torch.Tensor, k: int, generator: torch.Generator, interactions=None) -> torch.Tensor:
        return _top(scores, k)

    def inclusion(self, scores: torch.Tensor, k: int, generator: torch.Generator, interactions=None) -> torch.Tensor:
        pi = torch.zeros_like(scores)
        pi[_top(scores, k)] = 1.0
        return pi


class Uniform:
    """K uniformly without replacement (scores ignored)."""

    def select(self, scores: torch.Tensor, k: int, generator: torch.Generator, interactions=None) -> torch.Tensor:
        return torch.randperm(scores.shape[0], generator=generator)[:k]

    def inclusion(self, scores: torch.Tensor, k: int, generator: torch.Generator, interactions=None) -> torch.Tensor:
        return torch.full_like(scores, k / scores.shape[0])


class GumbelTopK:
    """Sampling without replacement ∝ exp(score/τ) (Plackett–Luce) via Gumbel-top-K.

    τ → 0 gives top-K, τ → ∞ uniform. Inclusion probabilities have no closed form; they are
    estimated from ``mc_draws`` extra Gumbel draws (O(N·draws), negligible next to scoring).

    Args:
        temperature: τ > 0, in the units of the scores.
        mc_draws: Monte-Carlo draws for the inclusion probabilities (ESS only).
    """

    def __init__(self, temperature: float = 1.0, mc_draws: int = 64) -> None:
        if not temperature > 0:
            raise ValueError(f"Gumbel-top-K temperature must be > 0, got {temperature}; use top_k for τ = 0")
        self.temperature = temperature
        self.mc_draws = mc_draws

    def select(self, scores: torch.Tensor, k: int, generator: torch.Generator, interactions=None) -> torch.Tensor:
        keys = scores.double() / self.temperature + gumbel_noise(scores.shape, generator)
        return _top(keys, k)

    def inclusion(self, scores: torch.Tensor, k: int, generator: torch.Generator, interactions=None) -> torch.Tensor:
        keys = scores.double()[None, :] / self.temperature + gumbel_noise((self.mc_draws, scores.shape[0]), generator)
        chosen = torch.zeros_like(keys)
        chosen.scatter_(1, torch.topk(keys, k, dim=1).indices, 1.0)
        return chosen.mean(0).to(scores.dtype)


class SequentialBoltzmann:
    """K sequential draws with an in-step interaction penalty (OPUS; GREATS when greedy).

    Draw i ∝ exp(g_i/τ) among the remaining (argmax when τ = 0), then g_j ← g_j − I_ij for the
    remaining j, K times, starting from g = scores. Without interactions and τ > 0 this is
    Plackett–Luce sampling (Gumbel-top-K); τ → 0 gives greedy, τ → ∞ uniform. Inclusion
    probabilities are estimated from ``mc_draws`` extra runs.

    Args:
        temperature: τ ≥ 0 in score units (0: greedy).
        mc_draws: Monte-Carlo runs for the inclusion probabilities (ESS only).
    """

    def __init__(self, temperature: float = 1.0, mc_draws: int = 32) -> None:
        if temperature < 0:
            raise ValueError(f"temperature must be ≥ 0 (0 is greedy), got {temperature}")
        self.temperature, self.mc_draws = temperature, mc_draws

    def _run(self, scores: torch.Tensor, k: int, generator: torch.Generator, interactions, draws: int) -> torch.Tensor:
        n = scores.shape[0]
        gains = scores.double().expand(draws, n).clone()
        penalty = interactions.double() if interactions is not None else None
        taken = torch.zeros(draws, n, dtype=torch.bool)
        rows = torch.arange(draws)
        picks = []
        for _ in range(k):
            keys = gains / self.temperature if self.temperature > 0 else gains.clone()
            if self.temperature > 0:
                keys = keys + gumbel_noise((draws, n), generator)
            keys[taken] = -torch.inf
            pick = keys.argmax(1)
            taken[rows, pick] = True
            picks.append(pick)
            if penalty is not None:
                gains -= penalty[pick]
        return torch.stack(picks, 1)

    def select(self, scores: torch.Tensor, k: int, generator: torch.Generator, interactions=None) -> torch.Tensor:
        return self._run(scores, k, generator, interactions, 1)[0]

    def inclusion(self, scores: torch.Tensor, k: int, generator: torch.Generator, interactions=None) -> torch.Tensor:
        draws = 1 if self.temperature == 0 else self.mc_draws
        picks = self._run(scores, k, generator, interactions, draws)
        pi = torch.zeros(draws, scores.shape[0], dtype=scores.dtype)
        pi.scatter_(1, picks, 1.0)
        return pi.mean(0)


def make_rule(name: str, temperature: float = 1.0) -> SamplingRule:
    """``"top_k"``, ``"gumbel"`` (Gumbel-top-K at ``temperature``), ``"uniform"``, or ``"boltzmann"``
    (sequential draws with an interaction penalty; ``temperature=0`` is greedy)."""
    if name == "top_k":
        return TopK()
    if name == "gumbel":
        return GumbelTopK(temperature)
    if name == "uniform":
        return Uniform()
    if name == "boltzmann":
        return SequentialBoltzmann(temperature)
    raise ValueError(f"unknown sampling rule {name!r}; choose top_k, gumbel, uniform or boltzmann")


def effective_sample_size(inclusion: torch.Tensor) -> float:
    """(Σπ)² / Σπ²: K for a deterministic choice, N for uniform."""
    return float(inclusion.sum() ** 2 / (inclusion.pow(2).sum()).clamp_min(1e-12))
