"""AutoData's recipe schema: a validated JSON spec that maps the feature table and a budget to a subset.

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
(:mod:`selection_callbacks.offline.autodata.sandbox.runner`: a fresh interpreter confined by the kernel,
bounded in memory, CPU and wall-clock seconds); term recipes are data and run in this process.
:func:`~selection_callbacks.offline.autodata.evaluation.run_recipe` applies a recipe and reports one
that is refused, breaks a sandbox rule, raises, hangs or returns the wrong size as a :class:`RecipeError`,
never a crash.

This module checks recipes (:func:`validate_recipe`) and reads them from files and presets (:func:`load_recipe`);
:mod:`selection_callbacks.offline.autodata.evaluation` applies them.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from selection_callbacks.offline.common.features import NUMERIC_FEATURES

__all__ = [
    "CATEGORICAL", "DERIVED_FEATURES", "FEATURES", "GATE_KEYS", "PRESET_DIR", "RECIPE_KEYS", "RULES", "RULE_DEFAULTS",
    "RecipeError", "TERM_KEYS", "canonical", "load_recipe", "recipe_features", "validate_recipe",
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


class RecipeError(ValueError):
    """A recipe that is invalid, raised, timed out or returned the wrong size (a failed trial)."""


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


def canonical(recipe: dict) -> str:
    """A recipe's identity for de-duplication (its validated form, name left out)."""
    return json.dumps({k: v for k, v in recipe.items() if k != "name"}, sort_keys=True)
