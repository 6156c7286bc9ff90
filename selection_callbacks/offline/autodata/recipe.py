"""AutoData selection recipes: a validated JSON spec that maps the feature table and a budget to a subset.

A recipe is data, not code, so a search (or an LLM agent) can write, mutate and compare them.

Schema (every key but ``terms`` optional; unknown keys are errors)::

    {
      "name": "paper-val-bpb",                      # free text
      "terms": [                                    # the composite score s_i
        {"feature": "loss_final",                   # a column of the feature table (FEATURES)
         "weight": -1.0,                            # w_k, finite
         "transform": "none" | "log",               # log x (x clipped at 1e-9) before normalising
         "shape": "linear" | "abs" | "tri",         # v = u, |u|, max(0, 1 − |u − centre| / width)
         "centre": 0.0, "width": 1.0,               # tri only: peak and half-width in u units
         "aggregate": "doc" | "cell",               # cell: the mean of u over the document's cell
         "gate": [{"feature": "distinct_avg", "weight": 1.0, "transform": "none"}]}
      ],                                            # gate: v ← v·(1 + g)/2, g = mean_j w_j u_j clipped to [−1, 1]
      "combine": "linear" | "multiplicative",       # s = Σ w_k v_k  |  s = Σ w_k log(ε + (1 + v_k)/2)
      "cells": ["cluster", "length_bin"],           # categorical columns that define cells
      "centre": {"shrinkage": 20.0} | null,         # s ← s − n_c/(n_c + κ)·(mean_c s − mean s)
      "rule": {"kind": "top"}                       # B best by s
            | {"kind": "threshold", "quantile": 0.5}      # random order among s ≥ q-quantile, then by s
            | {"kind": "gumbel", "temperature": 0.5}      # Gumbel-top-k of s / τ
            | {"kind": "tournament", "slate": 3, "temperature": 0.3}   # slates of k, winner max s + τ·G
            | {"kind": "quota", "alpha": 1.0, "temperature": 0.0},     # per-cell quotas ∝ tokens_c^α
      "backbone": 0.33                              # share of the budget drawn uniformly at random first
    }

Normalisation (the paper's tanh z̃): u = tanh((x − median) / (1.4826·MAD)), the robust z-score
squashed into (−1, 1); the standard deviation stands in when the MAD is 0, NaN becomes u = 0.
A recipe with no terms must have ``backbone`` 1 (uniform random selection).

Budget. Documents enter in the recipe's order: the backbone's random documents until they hold
``backbone``·B, then the rule's order over the rest; :meth:`Budget.take` keeps the shortest prefix
that meets B, so every recipe returns exactly the budget.

Programs. ``{"name": ..., "program": "path/to/recipe.py"}`` (or ``"code": "<python source>"``) runs
``select(table, n_tokens, budget, rng)`` from that file instead: ``table`` maps feature names to
arrays [D], ``budget`` has ``tokens``, ``docs``, ``take(order, n_tokens)`` and ``describe()`` like
:class:`Budget`, and it must return the chosen document indices, which must be exactly the budget
(``budget.take`` of their own order returns them unchanged). Programs run only in the sandbox
(:mod:`selection_callbacks.offline.autodata.sandbox`: a fresh interpreter confined by the kernel,
bounded in memory, CPU and wall-clock seconds); term recipes are data and run in this process.
:func:`run_recipe` reports a recipe that is refused, breaks a sandbox rule, raises, hangs or returns
the wrong size as a :class:`RecipeError`, never a crash.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from selection_callbacks.core.sampling import gumbel_keys, gumbel_order
from selection_callbacks.offline.autodata.sandbox_limits import SandboxLimits
from selection_callbacks.offline.common.corpus import Budget, Corpus
from selection_callbacks.offline.common.features import NGRAM_ORDERS, NUMERIC_FEATURES, FeatureBank

__all__ = [
    "CATEGORICAL", "DERIVED_FEATURES", "EPS", "FEATURES", "FeatureTable", "GATE_KEYS", "PRESET_DIR", "RECIPE_KEYS",
    "RULES", "RULE_DEFAULTS", "RecipeError", "TERM_KEYS", "apply_recipe_inline", "apply_term_recipe", "cell_ids",
    "check_subset", "composite_score", "feature_table", "load_recipe", "recipe_features", "robust_tanh_z", "rule_order",
    "run_recipe", "table_from_bank", "validate_recipe",
]

DERIVED_FEATURES = ("distinct_avg", "chars_per_token")
FEATURES = (*NUMERIC_FEATURES, *DERIVED_FEATURES)
CATEGORICAL = ("cluster", "length_bin")
RULES = {
    "top": {},
    "threshold": {"quantile": (0.0, 0.99)},
    "gumbel": {"temperature": (1e-3, 100.0)},
    "tournament": {"slate": (2, 64), "temperature": (0.0, 100.0)},
    "quota": {"alpha": (0.0, 1.0), "temperature": (0.0, 100.0)},
}
RULE_DEFAULTS = {"threshold": {"quantile": 0.5}, "gumbel": {"temperature": 1.0},
                 "tournament": {"slate": 3, "temperature": 0.0}, "quota": {"alpha": 1.0, "temperature": 0.0}}
TERM_KEYS = {"feature", "weight", "transform", "shape", "centre", "width", "aggregate", "gate"}
GATE_KEYS = {"feature", "weight", "transform"}
RECIPE_KEYS = {"name", "terms", "combine", "cells", "centre", "rule", "backbone", "program", "code"}
PRESET_DIR = Path(__file__).resolve().parent / "presets"
EPS = 1e-3


class RecipeError(ValueError):
    """A recipe that is invalid, raised, timed out or returned the wrong size (a failed trial)."""


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


# ---------------------------------------------------------------- validation


def _number(value: Any, where: str, lo: float = -math.inf, hi: float = math.inf) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RecipeError(f"{where} must be a finite number, got {value!r}")
    if not lo <= value <= hi:
        raise RecipeError(f"{where} must lie in [{lo}, {hi}], got {value}")
    return float(value)


def _choice(value: Any, where: str, options: tuple[str, ...]) -> str:
    if value not in options:
        raise RecipeError(f"{where} must be one of {list(options)}, got {value!r}")
    return value


def _keys(d: Any, allowed: set[str], where: str) -> dict:
    if not isinstance(d, dict):
        raise RecipeError(f"{where} must be a JSON object, got {type(d).__name__}")
    unknown = sorted(set(d) - allowed)
    if unknown:
        raise RecipeError(f"{where}: unknown field(s) {unknown}; allowed: {sorted(allowed)}")
    return d


def _feature(value: Any, where: str) -> str:
    if value not in FEATURES:
        raise RecipeError(f"{where}: unknown feature {value!r}; features: {list(FEATURES)}")
    return value


def _gate_term(g: Any, where: str) -> dict:
    g = _keys(g, GATE_KEYS, where)
    return {
        "feature": _feature(g.get("feature"), where),
        "weight": _number(g.get("weight", 1.0), f"{where}.weight"),
        "transform": _choice(g.get("transform", "none"), f"{where}.transform", ("none", "log")),
    }


def _term(t: Any, where: str) -> dict:
    t = _keys(t, TERM_KEYS, where)
    out = {
        "feature": _feature(t.get("feature"), where),
        "weight": _number(t.get("weight", 1.0), f"{where}.weight"),
        "transform": _choice(t.get("transform", "none"), f"{where}.transform", ("none", "log")),
        "shape": _choice(t.get("shape", "linear"), f"{where}.shape", ("linear", "abs", "tri")),
        "aggregate": _choice(t.get("aggregate", "doc"), f"{where}.aggregate", ("doc", "cell")),
    }
    if out["shape"] == "tri":
        out["centre"] = _number(t.get("centre", 0.0), f"{where}.centre", -1.0, 1.0)
        out["width"] = _number(t.get("width", 1.0), f"{where}.width", 1e-3, 2.0)
    elif "centre" in t or "width" in t:
        raise RecipeError(f"{where}: centre and width belong to shape 'tri' only")
    gate = t.get("gate")
    if gate is not None:
        if not isinstance(gate, list) or not gate:
            raise RecipeError(f"{where}.gate must be a non-empty list of terms")
        out["gate"] = [_gate_term(g, f"{where}.gate[{j}]") for j, g in enumerate(gate)]
    return out


def _rule(r: Any) -> dict:
    r = _keys(r, {"kind", *{k for p in RULES.values() for k in p}}, "rule")
    kind = _choice(r.get("kind"), "rule.kind", tuple(RULES))
    allowed = RULES[kind]
    extra = sorted(set(r) - {"kind", *allowed})
    if extra:
        raise RecipeError(f"rule {kind!r} takes {sorted(allowed) or 'no parameters'}, not {extra}")
    out: dict[str, Any] = {"kind": kind}
    for key, (lo, hi) in allowed.items():
        value = _number(r.get(key, RULE_DEFAULTS[kind][key]), f"rule.{key}", lo, hi)
        if key == "slate":
            if value != int(value):
                raise RecipeError(f"rule.slate must be an integer, got {value}")
            value = int(value)
        out[key] = value
    return out


def validate_recipe(recipe: Any) -> dict:
    """The recipe with defaults filled in, or a :class:`RecipeError` naming the first problem."""
    r = _keys(recipe, RECIPE_KEYS, "recipe")
    name = r.get("name", "unnamed")
    if not isinstance(name, str):
        raise RecipeError(f"recipe.name must be a string, got {name!r}")
    if "program" in r or "code" in r:
        if ("program" in r) == ("code" in r):
            raise RecipeError("give either program (a file) or code (source), not both")
        extra = sorted(set(r) - {"name", "program", "code"})
        if extra:
            raise RecipeError(f"a program recipe takes name and program|code only, not {extra}")
        key = "program" if "program" in r else "code"
        if not isinstance(r[key], str) or not r[key].strip():
            raise RecipeError(f"recipe.{key} must be a non-empty string")
        return {"name": name, key: r[key]}
    terms = r.get("terms")
    if not isinstance(terms, list):
        raise RecipeError("recipe.terms must be a list of terms (it may be empty only with backbone 1)")
    backbone = _number(r.get("backbone", 0.0), "recipe.backbone", 0.0, 1.0)
    if not terms and backbone < 1.0:
        raise RecipeError("a recipe without terms selects uniformly at random: set backbone to 1")
    cells = r.get("cells", ["cluster"])
    if not isinstance(cells, list) or not cells or any(c not in CATEGORICAL for c in cells):
        raise RecipeError(f"recipe.cells must be a non-empty list from {list(CATEGORICAL)}, got {cells!r}")
    centre = r.get("centre")
    if centre is not None:
        centre = {"shrinkage": _number(_keys(centre, {"shrinkage"}, "centre").get("shrinkage", 10.0),
                                       "centre.shrinkage", 0.0, 1e6)}
    return {
        "name": name,
        "terms": [_term(t, f"terms[{k}]") for k, t in enumerate(terms)],
        "combine": _choice(r.get("combine", "linear"), "recipe.combine", ("linear", "multiplicative")),
        "cells": list(dict.fromkeys(cells)),
        "centre": centre,
        "rule": _rule(r.get("rule", {"kind": "top"})),
        "backbone": backbone,
    }


def load_recipe(spec: str | Path | dict) -> dict:
    """A validated recipe from a dict, a JSON file or a preset name (``<name>.json`` in
    ``PRESET_DIR``, the package data folder ``selection_callbacks/offline/autodata/presets/``)."""
    if isinstance(spec, dict):
        return validate_recipe(spec)
    path = Path(spec)
    if not path.exists() and (PRESET_DIR / f"{spec}.json").exists():
        path = PRESET_DIR / f"{spec}.json"
    if not path.exists():
        presets = sorted(p.stem for p in PRESET_DIR.glob("*.json"))
        raise RecipeError(f"recipe {str(spec)!r} is neither a file nor a preset; presets: {presets}")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise RecipeError(f"recipe file {str(path)!r} is not valid JSON: {e}") from e
    return validate_recipe(raw)


def recipe_features(recipe: dict) -> set[str]:
    """Features a (validated) recipe reads, gates included."""
    return {t["feature"] for t in recipe.get("terms", [])} | {
        g["feature"] for t in recipe.get("terms", []) for g in t.get("gate", [])
    }


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
    from selection_callbacks.offline.autodata.sandbox import run_code  # the sandbox imports this module

    if "program" in recipe:
        source, filename = Path(recipe["program"]).read_text(), recipe["program"]
    else:
        source, filename = recipe["code"], "<recipe code>"
    limits = dataclasses.replace(limits or SandboxLimits(), wall_seconds=timeout)
    return run_code(source, filename, table, budget, seed, limits, trust_code)
