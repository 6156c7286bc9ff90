"""Applying a validated AutoData recipe: the feature table it reads and the subset it selects.

A term recipe runs here, in this process: each term's feature is normalised (:func:`robust_tanh_z`),
shaped, gated and weighted into the composite score s (:func:`composite_score`), centred within cells
if asked; the rule orders the documents the backbone left (:func:`rule_order`), and
:meth:`Budget.take` cuts the prefix that meets the budget (:func:`apply_term_recipe`). A code recipe
runs in the sandbox (:mod:`selection_callbacks.offline.autodata.sandbox.runner`). Either answer is
checked to be exactly the budget (:func:`check_subset`). What each field of a recipe means:
:mod:`selection_callbacks.offline.autodata.schema`.

Example::

    table = feature_table(feature_bank(pool, target, FeatureConfig()), pool)
    idx = run_recipe(load_recipe("autodata_best"), table, Budget(tokens=2_048_001), seed=0)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from selection_callbacks.core.sampling import gumbel_keys, gumbel_order
from selection_callbacks.offline.autodata.sandbox.limits import SandboxLimits
from selection_callbacks.offline.autodata.schema import RecipeError
from selection_callbacks.offline.common.corpus import Budget, Corpus
from selection_callbacks.offline.common.features import NGRAM_ORDERS, NUMERIC_FEATURES, FeatureBank

__all__ = [
    "EPS", "FeatureTable", "apply_recipe_inline", "apply_term_recipe", "cell_ids", "check_subset", "composite_score",
    "feature_table", "robust_tanh_z", "rule_order", "run_recipe", "table_from_bank",
]

EPS = 1e-3
"""ε of the multiplicative combination, s = Σ w_k log(ε + (1 + v_k)/2)."""


@dataclass(frozen=True)
class FeatureTable:
    """The columns recipes read: the bank's numeric features, derived ones and categorical cells.

    Attributes:
        numeric: name → float64 [D] (FEATURES).
        categorical: name → int64 [D] (CATEGORICAL).
        n_tokens: int64 [D] tokens per document (the budget's unit).
    """

    numeric: dict[str, np.ndarray]
    categorical: dict[str, np.ndarray]
    n_tokens: np.ndarray

    def __len__(self) -> int:
        return int(self.n_tokens.size)

    def columns(self) -> dict[str, np.ndarray]:
        """Every column by name (what programs receive)."""
        return {**self.numeric, **self.categorical}


def feature_table(bank: FeatureBank, pool: Corpus) -> FeatureTable:
    """Bank columns plus ``distinct_avg`` (mean distinct n-gram ratio, n = 1..5), ``chars_per_token``
    (Unicode characters per byte token) and ``length_bin`` (n_tokens quartile, 0..3)."""
    if not np.array_equal(bank.ids, pool.ids):
        raise ValueError("the feature bank was computed for another pool (document ids differ)")
    return table_from_bank(bank, np.asarray([len(t) for t in pool.texts]), pool.n_tokens)


def table_from_bank(bank: FeatureBank, n_chars: np.ndarray, n_tokens: np.ndarray) -> FeatureTable:
    """:func:`feature_table` from the bank and each document's Unicode characters [D] and tokens [D], no text."""
    numeric = {n: bank.columns[n].astype(np.float64) for n in NUMERIC_FEATURES}
    numeric["distinct_avg"] = np.mean([numeric[f"distinct_{n}"] for n in NGRAM_ORDERS], axis=0)
    numeric["chars_per_token"] = np.asarray(n_chars, dtype=np.float64) / n_tokens
    edges = np.quantile(n_tokens, [0.25, 0.5, 0.75])
    categorical = {
        "cluster": bank.columns["cluster"].astype(np.int64),
        "length_bin": np.searchsorted(edges, n_tokens, side="right").astype(np.int64),
    }
    return FeatureTable(numeric, categorical, np.asarray(n_tokens).astype(np.int64))


# ---------------------------------------------------------------- scoring


def robust_tanh_z(x: np.ndarray) -> np.ndarray:
    """u = tanh((x − median)/(1.4826·MAD)); std when MAD = 0; NaN → 0."""
    finite = np.isfinite(x)
    if not finite.any():
        return np.zeros_like(x)
    med = np.median(x[finite])
    scale = 1.4826 * np.median(np.abs(x[finite] - med))
    if not scale > 0:
        scale = float(np.std(x[finite]))
    z = (x - med) / scale if scale > 0 else np.zeros_like(x)
    return np.tanh(np.nan_to_num(z, nan=0.0, posinf=0.0, neginf=0.0))


def _normalised(table: FeatureTable, feature: str, transform: str) -> np.ndarray:
    x = table.numeric[feature]
    if transform == "log":
        x = np.log(np.clip(x, 1e-9, None))
    return robust_tanh_z(x)


def cell_ids(table: FeatureTable, cells: list[str]) -> np.ndarray:
    """int64 [D]: one id per combination of the categorical columns."""
    keys = np.stack([table.categorical[c] for c in cells], axis=1)
    return np.unique(keys, axis=0, return_inverse=True)[1].reshape(-1)


def _cell_mean(values: np.ndarray, cell: np.ndarray) -> np.ndarray:
    sums = np.bincount(cell, weights=values)
    counts = np.bincount(cell)
    return (sums / np.maximum(counts, 1))[cell]


def composite_score(recipe: dict, table: FeatureTable) -> np.ndarray:
    """s [D] of a validated term recipe (zeros when it has no terms), centred within cells if asked."""
    D = len(table)
    cell = cell_ids(table, recipe["cells"])
    s = np.zeros(D)
    for t in recipe["terms"]:
        u = _normalised(table, t["feature"], t["transform"])
        if t["aggregate"] == "cell":
            u = _cell_mean(u, cell)
        if t["shape"] == "abs":
            v = np.abs(u)
        elif t["shape"] == "tri":
            v = np.maximum(0.0, 1.0 - np.abs(u - t["centre"]) / t["width"])
        else:
            v = u
        if "gate" in t:
            g = np.mean([gt["weight"] * _normalised(table, gt["feature"], gt["transform"]) for gt in t["gate"]], axis=0)
            v = v * (1.0 + np.clip(g, -1.0, 1.0)) / 2.0
        s += t["weight"] * (np.log(EPS + (1.0 + v) / 2.0) if recipe["combine"] == "multiplicative" else v)
    if recipe["centre"] is not None:
        kappa = recipe["centre"]["shrinkage"]
        counts = np.bincount(cell)[cell]
        s = s - counts / (counts + kappa) * (_cell_mean(s, cell) - s.mean())
    return s


# ---------------------------------------------------------------- selection rules


def _tournament_order(s: np.ndarray, candidates: np.ndarray, slate: int, tau: float, rng: np.random.Generator) -> np.ndarray:
    """Rounds of slate tournaments over the remaining candidates; winners in round order."""
    order, remaining = [], candidates
    while remaining.size:
        perm = rng.permutation(remaining)
        n_slates = -(-perm.size // slate)
        padded = np.full(n_slates * slate, -1)
        padded[: perm.size] = perm
        slates = padded.reshape(n_slates, slate)
        key = np.where(slates >= 0, gumbel_keys(s[np.maximum(slates, 0)], rng, tau, scale_noise=True), -np.inf)
        winners = slates[np.arange(n_slates), key.argmax(1)]
        order.append(winners[np.argsort(-s[winners], kind="stable")])
        remaining = np.setdiff1d(remaining, winners, assume_unique=True)
    return np.concatenate(order)


def _quota_order(
    s: np.ndarray, candidates: np.ndarray, cell: np.ndarray, n_tokens: np.ndarray, alpha: float, tau: float,
    rng: np.random.Generator,
) -> np.ndarray:
    """Interleave cells so every prefix fills cell c's share ∝ (pool tokens of c)^α, best first within cells."""
    key = gumbel_keys(s[candidates], rng, tau, scale_noise=True) if tau > 0 else s[candidates]
    c = cell[candidates]
    cell_tokens = np.bincount(c, weights=n_tokens[candidates])
    share = np.where(cell_tokens > 0, cell_tokens**alpha, 0.0)
    share = share / share.sum()
    order = np.lexsort((-key, c))  # by cell, best first within
    sorted_c = c[order]
    cum = np.cumsum(n_tokens[candidates][order])
    starts = np.searchsorted(sorted_c, np.arange(share.size))
    before = np.concatenate([[0.0], cum])[starts][sorted_c]
    fill = (cum - before) / share[sorted_c]  # tokens of the cell up to this document, per unit share
    return candidates[order[np.argsort(fill, kind="stable")]]


def rule_order(recipe: dict, s: np.ndarray, candidates: np.ndarray, table: FeatureTable, rng: np.random.Generator) -> np.ndarray:
    """The rule's ranking of ``candidates`` (best first)."""
    r = recipe["rule"]
    if candidates.size == 0:
        return candidates
    if r["kind"] == "top":
        return candidates[np.argsort(-s[candidates], kind="stable")]
    if r["kind"] == "threshold":
        cut = np.quantile(s[candidates], r["quantile"])
        above = rng.permutation(candidates[s[candidates] >= cut])
        below = candidates[s[candidates] < cut]
        return np.concatenate([above, below[np.argsort(-s[below], kind="stable")]])
    if r["kind"] == "gumbel":
        return candidates[gumbel_order(s[candidates], rng, r["temperature"])]
    if r["kind"] == "tournament":
        return _tournament_order(s, candidates, r["slate"], r["temperature"], rng)
    return _quota_order(s, candidates, cell_ids(table, recipe["cells"]), table.n_tokens, r["alpha"], r["temperature"], rng)


def apply_term_recipe(recipe: dict, table: FeatureTable, budget: Budget, seed: int) -> np.ndarray:
    """Indices [S] of a validated term recipe: backbone first, then the rule's order, budget prefix."""
    rng = np.random.default_rng([seed, 0xA07D])
    D = len(table)
    perm = rng.permutation(D)
    if recipe["backbone"] >= 1.0:
        return budget.take(perm, table.n_tokens)
    n_back = 0
    if recipe["backbone"] > 0:
        if budget.docs is not None:
            n_back = int(round(recipe["backbone"] * budget.docs))
        else:
            cum = np.cumsum(table.n_tokens[perm])
            n_back = int(np.searchsorted(cum, recipe["backbone"] * budget.tokens))
    backbone, rest = perm[:n_back], np.sort(perm[n_back:])
    s = composite_score(recipe, table)
    return budget.take(np.concatenate([backbone, rule_order(recipe, s, rest, table, rng)]), table.n_tokens)


def apply_recipe_inline(recipe: dict, table: FeatureTable, budget: Budget, seed: int) -> np.ndarray:
    """Run a validated term recipe in this process and check its answer is exactly the budget.

    Raises:
        RecipeError: the recipe is code (code runs only in the sandbox: :func:`run_recipe`), or its
            answer is not exactly the budget.
    """
    if "program" in recipe or "code" in recipe:
        raise RecipeError("code recipes run only in the sandbox: use run_recipe")
    idx = apply_term_recipe(recipe, table, budget, seed)
    check_subset(idx, table.n_tokens, budget)
    return idx.astype(np.int64)


def check_subset(idx: np.ndarray, n_tokens: np.ndarray, budget: Budget) -> None:
    """Distinct in-range integer indices that are exactly the budget, or a RecipeError saying what is wrong."""
    if idx.ndim != 1 or (idx.size and not np.issubdtype(idx.dtype, np.integer)):
        raise RecipeError(f"a recipe must return a 1-d array of document indices, got shape {idx.shape} {idx.dtype}")
    if idx.size and (idx.min() < 0 or idx.max() >= n_tokens.size):
        raise RecipeError(f"document indices out of range [0, {n_tokens.size})")
    if np.unique(idx).size != idx.size:
        raise RecipeError(f"{idx.size - np.unique(idx).size} repeated document(s)")
    try:
        exact = np.array_equal(budget.take(idx, n_tokens), idx)
    except ValueError:
        exact = False
    if not exact:
        raise RecipeError(
            f"wrong size: {idx.size} documents, {int(n_tokens[idx].sum()) if idx.size else 0} tokens, "
            f"for a budget of {budget.describe()} (exactly the budget: Budget.take of the answer's order)"
        )


def run_recipe(recipe: dict, table: FeatureTable, budget: Budget, seed: int, timeout: float = 60.0,
               limits: SandboxLimits | None = None, trust_code: bool = False) -> np.ndarray:
    """Apply a validated recipe: a term recipe in this process, code in the sandbox.

    Args:
        timeout: wall-clock seconds a code recipe may take.
        limits: its CPU seconds and memory (None = the defaults); ``limits.wall_seconds`` is ``timeout``.
        trust_code: run code even where the kernel lacks the sandbox's mechanisms.

    Returns the indices; raises :class:`RecipeError` when the recipe is refused, breaks a sandbox
    rule, raises, times out, dies or returns something other than exactly the budget.
    """
    if "program" not in recipe and "code" not in recipe:
        return apply_recipe_inline(recipe, table, budget, seed)
    from selection_callbacks.offline.autodata.sandbox.runner import run_code  # the sandbox imports this module

    if "program" in recipe:
        source, filename = Path(recipe["program"]).read_text(), recipe["program"]
    else:
        source, filename = recipe["code"], "<recipe code>"
    limits = dataclasses.replace(limits or SandboxLimits(), wall_seconds=timeout)
    return run_code(source, filename, table, budget, seed, limits, trust_code)
