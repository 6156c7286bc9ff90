"""The offline labelled oracle: a subset of the budget drawn from the target's domains first.

The ceiling of the offline kind, as :class:`~selection_callbacks.methods.oracle.callback.OracleDomainSelection`
is of the online kind: it reads the domain labels a real selector does not have. Documents of the
target's domains (the domains of the target split, or ``target_domains``) come first in a seeded
random order, then every other document in a seeded random order, and :meth:`Budget.take` cuts the
prefix: the subset holds nothing outside the target's domains until they are used up.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from selection_callbacks.offline.common.corpus import Budget, Corpus, Selection, SelectionError

__all__ = ["OracleConfig", "oracle_order", "select_oracle"]


@dataclass
class OracleConfig:
    """Offline oracle settings.

    Attributes:
        target_domains: domain names to take first; empty = the target split's domains.
    """

    target_domains: list[str] = field(default_factory=list)


def oracle_order(domains: np.ndarray, wanted: set[str], seed: int) -> np.ndarray:
    """Indices of the wanted-domain documents (seeded random order), then of the rest (seeded random order)."""
    rng = np.random.default_rng([seed, 0x0AC1E])
    inside = np.isin(domains, sorted(wanted))
    first, rest = np.flatnonzero(inside), np.flatnonzero(~inside)
    return np.concatenate([rng.permutation(first), rng.permutation(rest)])


def select_oracle(
    pool: Corpus, target: Corpus, budget: Budget, seed: int, cfg: OracleConfig, progress: bool = True
) -> Selection:
    """The target's domains first, at random within, cut by the budget."""
    wanted = set(cfg.target_domains) or set(target.domains.tolist())
    if not np.isin(pool.domains, sorted(wanted)).any():
        raise SelectionError(f"no pool document is in the target domains {sorted(wanted)}; the pool has "
                             f"{sorted(set(pool.domains.tolist()))}")
    chosen = budget.take(oracle_order(pool.domains, wanted, seed), pool.n_tokens)
    inside = np.isin(pool.domains, sorted(wanted))
    return Selection(chosen, {
        "target_domains": sorted(wanted),
        "target_domain_tokens_in_pool": int(pool.n_tokens[inside].sum()),
        "target_domain_token_share": float(pool.n_tokens[chosen][inside[chosen]].sum() / pool.n_tokens[chosen].sum()),
    })
