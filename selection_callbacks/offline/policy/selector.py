"""Learned selection policy (the report's third method): a linear scorer trained by REINFORCE.

Policy. Standardised features z_i ∈ ℝ^F of document i (feature-bank columns, z-scored over the
pool, NaN → 0) and weights w ∈ ℝ^F give scores s_i = w·z_i. A subset is the budget prefix of a
Gumbel-top-k order of s, i.e. a Plackett–Luce draw without replacement:

    log P(π | w) = Σ_k [ s_{π_k} − log Σ_{j ∉ {π_1..π_{k−1}}} e^{s_j} ].

Reward. R(S) = −(mean nats per byte token of the target split) of a *fresh* small proxy trained on
the documents of S for ``rollout_tokens`` tokens. Every rollout of a round uses the same proxy seed
(common random numbers: the group's rewards differ by their subsets, not their initialisations).

Update (group-relative REINFORCE, Fan et al. 2025). Each round draws G subsets, A_g = (R_g − mean R)
/ std R over the group, and w ascends (1/G) Σ_g A_g ∇_w log P(π_g | w) with Adam.

Noise. The std of the group's rewards is logged per round, and ``noise_repeats`` rollouts of one
fixed subset (the final selection) under different proxy seeds measure the reward's own noise:
a round's ranking means something only when the group std clearly exceeds it.

The final subset is a Gumbel-top-k draw from the learned scores with the selection seed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch
from tqdm.auto import tqdm

from selection_callbacks.core.sampling import gumbel_order
from selection_callbacks.offline.common.corpus import Budget, Corpus, Selection
from selection_callbacks.offline.common.features import FeatureConfig, feature_bank, standardised_columns
from selection_callbacks.offline.common.proxy_reward import ProxyReward
from selection_callbacks.offline.common.proxy_train import ProxyConfig

__all__ = [
    "PolicyConfig", "PolicyResult", "REPORT_FEATURES", "RewardFn", "learn_policy", "plackett_luce_log_prob",
    "select_policy",
]

REPORT_FEATURES = (
    "loss_final", "delta", "distinct_1", "non_ascii", "log_freq", "bos_per_seq", "byte_entropy", "grad_align", "dsir",
)


@dataclass
class PolicyConfig:
    """Learned-policy settings.

    Attributes:
        features: feature-bank columns the linear policy reads (default: the report's eight + DSIR).
        group_size: G, rollouts per round.
        rounds: R, policy updates.
        lr: Adam step size on the weights.
        rollout_tokens: tokens each rollout's fresh proxy trains on.
        rollout_proxy: the rollout proxies' shape and optimiser.
        reward_windows: target windows (evenly spaced) the reward is measured on; None = all.
        workers: parallel rollout processes (1 = in this process).
        noise_repeats: rollouts of the final subset under different proxy seeds, to measure reward noise
            (0 = skip, else ≥ 2).
        bank: the feature bank.
    """

    features: tuple[str, ...] = REPORT_FEATURES
    group_size: int = 8
    rounds: int = 10
    lr: float = 0.1
    rollout_tokens: int = 65_536
    rollout_proxy: ProxyConfig = field(default_factory=lambda: ProxyConfig(lr=1e-2))
    reward_windows: int | None = 128
    workers: int = 1
    noise_repeats: int = 4
    bank: FeatureConfig = field(default_factory=FeatureConfig)


class RewardFn(Protocol):
    def __call__(self, subsets: list[np.ndarray], seeds: list[int]) -> np.ndarray:
        """Reward [len(subsets)] of each subset (pool indices); ``seeds[i]`` drives rollout i's randomness."""
        ...


def plackett_luce_log_prob(scores: torch.Tensor, picked: torch.Tensor) -> torch.Tensor:
    """log P(drawing ``picked`` in that order, without replacement, ∝ exp(scores)).

    The normaliser before draw k is Σ_{unpicked} e^s + Σ_{j ≥ k} e^{s_{π_j}}: sums of positive
    terms only (no cancellation), O(N + S).
    """
    m = scores.detach().max()
    e = torch.exp(scores - m)
    unpicked = torch.ones_like(scores, dtype=torch.bool)
    unpicked[picked] = False
    tail = torch.flip(torch.cumsum(torch.flip(e[picked], [0]), 0), [0])
    return (scores[picked] - m - torch.log(e[unpicked].sum() + tail)).sum()


@dataclass
class PolicyResult:
    """Learned weights [F] and the per-round reward statistics."""

    weights: np.ndarray
    history: list[dict[str, Any]]


def learn_policy(
    z: np.ndarray,
    n_tokens: np.ndarray,
    budget: Budget,
    reward: RewardFn,
    seed: int,
    group_size: int = 8,
    rounds: int = 10,
    lr: float = 0.1,
    progress: bool = True,
) -> PolicyResult:
    """REINFORCE with group-relative advantages on a linear policy over standardised features z [D, F]."""
    if group_size < 2:
        raise ValueError(f"group-relative advantages need group_size ≥ 2, got {group_size}")
    if rounds < 1:
        raise ValueError(f"rounds must be ≥ 1, got {rounds}")
    x = torch.from_numpy(np.ascontiguousarray(z, dtype=np.float64))
    w = torch.zeros(x.shape[1], dtype=torch.float64, requires_grad=True)
    opt = torch.optim.Adam([w], lr=lr)
    history = []
    bar = tqdm(range(rounds), desc="policy: rounds", unit="round", disable=not progress)
    for r in bar:
        rng = np.random.default_rng([seed, r, 0x9011C7])
        scores = x @ w
        subsets = [budget.take(gumbel_order(scores.detach().numpy(), rng), n_tokens) for _ in range(group_size)]
        rewards = np.asarray(reward(subsets, [int(rng.integers(2**31))] * group_size), dtype=np.float64)
        std = float(rewards.std())
        adv = (rewards - rewards.mean()) / std if std > 0 else np.zeros_like(rewards)
        objective = sum(float(a) * plackett_luce_log_prob(scores, torch.from_numpy(s)) for a, s in zip(adv, subsets))
        opt.zero_grad()
        (-objective / group_size).backward()
        opt.step()
        history.append({"round": r, "reward_mean": float(rewards.mean()), "reward_std": std,
                        "reward_max": float(rewards.max())})
        bar.set_postfix(reward=f"{rewards.mean():.4f}±{std:.4f}")
    return PolicyResult(weights=w.detach().numpy().copy(), history=history)


def select_policy(
    pool: Corpus, target: Corpus, budget: Budget, seed: int, cfg: PolicyConfig, progress: bool = True
) -> Selection:
    """Learn w on the feature bank with proxy rewards, then draw the subset from the learned policy."""
    if cfg.noise_repeats == 1 or cfg.noise_repeats < 0:
        raise ValueError(f"noise_repeats must be 0 (skip) or ≥ 2 (a std needs two rollouts), got {cfg.noise_repeats}")
    bank = feature_bank(pool, target, cfg.bank, progress=progress)
    z, mean, std = standardised_columns(bank.matrix(cfg.features))
    with ProxyReward(pool, target, cfg.rollout_proxy, cfg.rollout_tokens, cfg.reward_windows, cfg.workers) as reward:
        result = learn_policy(
            z, pool.n_tokens, budget, reward, seed, cfg.group_size, cfg.rounds, cfg.lr, progress=progress
        )
        chosen = budget.take(gumbel_order(z @ result.weights, np.random.default_rng([seed, 0xF1])), pool.n_tokens)
        noise = None
        if cfg.noise_repeats:
            seeds = np.random.default_rng([seed, 0x4015E]).integers(2**31, size=cfg.noise_repeats)
            noise = float(reward([chosen] * cfg.noise_repeats, seeds.tolist()).std(ddof=1))
        per_rollout = reward.seconds / max(reward.count, 1)
    print("policy weights (on standardised features):")
    for name, wi in sorted(zip(cfg.features, result.weights), key=lambda t: -abs(t[1])):
        print(f"  {name:>14s} {wi:+.4f}")
    group_std = float(np.mean([h["reward_std"] for h in result.history]))
    print(f"reward: group std {group_std:.4f} (mean over rounds), noise std of one subset {noise}")
    return Selection(
        chosen,
        {
            "weights": dict(zip(cfg.features, result.weights.tolist())),
            "standardisation": {
                "mean": dict(zip(cfg.features, mean.tolist())), "std": dict(zip(cfg.features, std.tolist()))
            },
            "rounds": result.history,
            "reward_group_std_mean": group_std,
            "reward_noise_std": noise,
            "rollouts": reward.count,
            "seconds_per_rollout": round(per_rollout, 3),
        },
    )
