"""AutoData recipes: validation errors, scoring math, every rule's budget and behaviour, presets,
and the sandbox that turns an exception, a timeout or a wrong size into a RecipeError."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from selection_callbacks.offline.autodata.evaluation import (
    FeatureTable,
    apply_recipe_inline,
    cell_ids,
    composite_score,
    robust_tanh_z,
    run_recipe,
)
from selection_callbacks.offline.autodata.schema import FEATURES, RecipeError, load_recipe, validate_recipe
from selection_callbacks.offline.common.corpus import Budget

D = 400


@pytest.fixture(scope="module")
def table() -> FeatureTable:
    rng = np.random.default_rng(0)
    numeric = {f: rng.lognormal(0.0, 1.0, D) for f in FEATURES}
    categorical = {"cluster": rng.integers(0, 4, D), "length_bin": rng.integers(0, 3, D)}
    return FeatureTable(numeric, categorical, rng.integers(50, 500, D))


def _exact(table: FeatureTable, budget: Budget, idx: np.ndarray) -> bool:
    return np.unique(idx).size == idx.size and np.array_equal(budget.take(idx, table.n_tokens), idx)


def one_term(feature: str = "distinct_1", **rule) -> dict:
    return {"terms": [{"feature": feature}], "rule": rule or {"kind": "top"}}


@pytest.mark.parametrize(
    ("recipe", "message"),
    [
        ({"terms": [{"feature": "distinct_1"}], "colour": 1}, r"unknown field\(s\) \['colour'\]"),
        ({"terms": [{"feature": "nope"}]}, "terms\\[0\\]: unknown feature 'nope'"),
        ({"terms": [{"feature": "distinct_1", "weight": float("nan")}]}, "terms\\[0\\].weight must be a finite number"),
        ({"terms": [{"feature": "distinct_1", "shape": "cube"}]}, "shape must be one of"),
        ({"terms": [{"feature": "distinct_1", "width": 2}]}, "centre and width belong to shape 'tri'"),
        ({"terms": []}, "without terms selects uniformly at random: set backbone to 1"),
        ({"terms": [{"feature": "distinct_1"}], "rule": {"kind": "top", "slate": 3}}, "rule 'top' takes no parameters"),
        ({"terms": [{"feature": "distinct_1"}], "rule": {"kind": "tournament", "slate": 1}}, r"rule.slate must lie in \[2"),
        ({"terms": [{"feature": "distinct_1"}], "rule": {"kind": "tournament", "slate": 2.5}}, "slate must be an integer"),
        ({"terms": [{"feature": "distinct_1"}], "backbone": 1.5}, r"backbone must lie in \[0.0, 1.0\]"),
        ({"terms": [{"feature": "distinct_1"}], "cells": ["domain"]}, "recipe.cells must be a non-empty list"),
        ({"terms": [{"feature": "distinct_1", "gate": []}]}, "gate must be a non-empty list"),
        ({"code": "x", "terms": []}, "a program recipe takes name and program|code only"),
        ([1, 2], "recipe must be a JSON object, got list"),
    ],
)
def test_validation_names_the_problem(recipe, message) -> None:
    with pytest.raises(RecipeError, match=message):
        validate_recipe(recipe)


def test_validation_fills_defaults() -> None:
    r = validate_recipe(one_term())
    assert r["combine"] == "linear" and r["cells"] == ["cluster"] and r["centre"] is None and r["backbone"] == 0.0
    assert r["terms"][0] == {"feature": "distinct_1", "weight": 1.0, "transform": "none", "shape": "linear",
                             "aggregate": "doc"}
    assert validate_recipe(one_term(kind="quota"))["rule"] == {"kind": "quota", "alpha": 1.0, "temperature": 0.0}
    assert validate_recipe(r) == r  # idempotent


def test_robust_tanh_z() -> None:
    x = np.array([1.0, 2.0, 3.0, 4.0, 100.0, np.nan])
    u = robust_tanh_z(x)
    med, mad = 3.0, np.median(np.abs(x[:5] - 3.0))
    np.testing.assert_allclose(u[:5], np.tanh((x[:5] - med) / (1.4826 * mad)))
    assert u[5] == 0.0 and np.all(np.abs(u) <= 1)
    assert np.all(robust_tanh_z(np.full(5, 7.0)) == 0.0)


def test_linear_top_keeps_the_highest_scores(table) -> None:
    budget = Budget(docs=50)
    idx = apply_recipe_inline(validate_recipe(one_term()), table, budget, 0)
    np.testing.assert_array_equal(np.sort(idx), np.sort(np.argsort(-table.numeric["distinct_1"], kind="stable")[:50]))
    low = apply_recipe_inline(validate_recipe({"terms": [{"feature": "distinct_1", "weight": -2.0}]}), table, budget, 0)
    np.testing.assert_array_equal(np.sort(low), np.sort(np.argsort(table.numeric["distinct_1"], kind="stable")[:50]))


def test_composite_score_math(table) -> None:
    u = {f: robust_tanh_z(table.numeric[f]) for f in ("distinct_1", "n_tokens", "dsir")}
    ulog = robust_tanh_z(np.log(table.numeric["n_tokens"]))
    r = validate_recipe({"terms": [
        {"feature": "distinct_1", "weight": 0.5},
        {"feature": "n_tokens", "transform": "log", "shape": "abs", "weight": -1.0},
        {"feature": "dsir", "shape": "tri", "centre": 0.2, "width": 0.5, "weight": 2.0,
         "gate": [{"feature": "distinct_1"}, {"feature": "n_tokens", "weight": -1.0}]},
    ]})
    gate = np.clip((u["distinct_1"] - u["n_tokens"]) / 2, -1, 1)
    expect = 0.5 * u["distinct_1"] - np.abs(ulog) + 2.0 * np.maximum(0, 1 - np.abs(u["dsir"] - 0.2) / 0.5) * (1 + gate) / 2
    np.testing.assert_allclose(composite_score(r, table), expect)
    mult = validate_recipe({**r, "combine": "multiplicative"})
    v = [u["distinct_1"], np.abs(ulog), np.maximum(0, 1 - np.abs(u["dsir"] - 0.2) / 0.5) * (1 + gate) / 2]
    expect = sum(w * np.log(1e-3 + (1 + vi) / 2) for w, vi in zip((0.5, -1.0, 2.0), v))
    np.testing.assert_allclose(composite_score(mult, table), expect)


def test_shrinkage_centring_and_cell_aggregate(table) -> None:
    base = validate_recipe({"terms": [{"feature": "dsir"}], "cells": ["cluster", "length_bin"]})
    s = composite_score(base, table)
    cell = cell_ids(table, ["cluster", "length_bin"])
    means = lambda x: np.array([x[cell == c].mean() for c in np.unique(cell)])  # noqa: E731
    full = composite_score({**base, "centre": {"shrinkage": 0.0}}, table)
    np.testing.assert_allclose(means(full), s.mean())  # κ = 0: every cell centred on the global mean
    np.testing.assert_allclose(composite_score({**base, "centre": {"shrinkage": 1e6}}, table), s, atol=1e-3)
    half = composite_score({**base, "centre": {"shrinkage": 10.0}}, table)
    n = np.bincount(cell)[np.unique(cell)]
    np.testing.assert_allclose(means(half) - s.mean(), (means(s) - s.mean()) * 10.0 / (n + 10.0))
    agg = composite_score(validate_recipe({**base, "terms": [{"feature": "dsir", "aggregate": "cell"}]}), table)
    np.testing.assert_allclose(agg, means(s)[np.searchsorted(np.unique(cell), cell)])


RULES = [
    {"kind": "top"}, {"kind": "threshold", "quantile": 0.7}, {"kind": "gumbel", "temperature": 0.3},
    {"kind": "tournament", "slate": 3, "temperature": 0.2}, {"kind": "quota", "alpha": 0.5, "temperature": 0.1},
]


@pytest.mark.parametrize(("rule", "budget", "backbone"), list(itertools.product(
    RULES, [Budget(docs=37), Budget(tokens=20_000)], [0.0, 0.4])))
def test_every_rule_returns_exactly_the_budget_and_is_seeded(table, rule, budget, backbone) -> None:
    r = validate_recipe({**one_term(**rule), "backbone": backbone})
    a, b, c = (apply_recipe_inline(r, table, budget, s) for s in (0, 0, 1))
    assert _exact(table, budget, a)
    np.testing.assert_array_equal(a, b)
    if rule["kind"] != "top" or backbone:
        assert not np.array_equal(a, c)


def test_rules_behave_as_specified(table) -> None:
    s = robust_tanh_z(table.numeric["distinct_1"])
    docs = Budget(docs=60)
    thr = apply_recipe_inline(validate_recipe(one_term(kind="threshold", quantile=0.8)), table, docs, 0)
    assert np.all(s[thr] >= np.quantile(s, 0.8))  # 80 documents clear the cut; 60 are drawn among them
    assert not np.array_equal(np.sort(thr), np.sort(np.argsort(-s)[:60]))
    tour = apply_recipe_inline(validate_recipe(one_term(kind="tournament", slate=4, temperature=0.0)), table, docs, 0)
    assert s.argmax() in tour and not np.isin(np.argsort(s)[:3], tour).any()  # the 3 worst lose every slate
    cold = apply_recipe_inline(validate_recipe(one_term(kind="gumbel", temperature=1e-3)), table, docs, 0)
    np.testing.assert_array_equal(np.sort(cold), np.sort(np.argsort(-s, kind="stable")[:60]))
    hot = apply_recipe_inline(validate_recipe(one_term(kind="gumbel", temperature=100.0)), table, Budget(docs=200), 0)
    assert abs(s[hot].mean() - s.mean()) < 0.1 < s[np.argsort(-s)[:200]].mean() - s.mean()
    budget = Budget(tokens=int(table.n_tokens.sum() * 0.3))
    quota = apply_recipe_inline(validate_recipe({**one_term(kind="quota", alpha=1.0), "cells": ["cluster"]}),
                                table, budget, 0)
    cl = table.categorical["cluster"]
    share = np.bincount(cl[quota], weights=table.n_tokens[quota], minlength=4) / table.n_tokens[quota].sum()
    pool = np.bincount(cl, weights=table.n_tokens, minlength=4) / table.n_tokens.sum()
    np.testing.assert_allclose(share, pool, atol=0.03)
    top = apply_recipe_inline(validate_recipe(one_term()), table, docs, 0)
    back = apply_recipe_inline(validate_recipe({**one_term(), "backbone": 0.5}), table, docs, 0)
    assert 20 <= np.isin(back, top).sum() <= 40  # about half the budget is drawn at random first


@pytest.mark.parametrize("name", ["uniform", "paper_val_bpb", "paper_core"])
def test_presets_run(table, name) -> None:
    budget = Budget(tokens=30_000)
    recipe = load_recipe(name)
    assert _exact(table, budget, run_recipe(recipe, table, budget, 0))
    if name == "uniform":
        assert recipe["terms"] == [] and recipe["backbone"] == 1.0


def test_programs_and_their_failures(table, tmp_path) -> None:
    budget = Budget(docs=25)
    good = tmp_path / "good.py"
    good.write_text("import numpy as np\n"
                    "def select(table, n_tokens, budget, rng):\n"
                    "    return np.argsort(-table['dsir'], kind='stable')[: budget.docs]\n")
    idx = run_recipe(validate_recipe({"program": str(good)}), table, budget, 0)
    np.testing.assert_array_equal(idx, np.argsort(-table.numeric["dsir"], kind="stable")[:25])
    cases = {
        "def select(table, n_tokens, budget, rng):\n    raise KeyError('no such column')\n": "raised KeyError",
        "import time\ndef select(table, n_tokens, budget, rng):\n    time.sleep(30)\n": "timed out after 3 s",
        "def select(table, n_tokens, budget, rng):\n    return list(range(budget.docs - 1))\n": "wrong size: 24 documents",
        "def select(table, n_tokens, budget, rng):\n    return [0] * budget.docs\n": "repeated document",
        "def select(table, n_tokens, budget, rng):\n    return [10**6]\n": "out of range",
        "x = 1\n": "defines no select",
        "import os\ndef select(table, n_tokens, budget, rng):\n    os._exit(3)\n": "died",
    }
    for code, message in cases.items():
        with pytest.raises(RecipeError, match=message):
            timeout = 3.0 if "sleep" in code else 30.0  # a fresh interpreter starts in well under 3 s
            run_recipe(validate_recipe({"code": code}), table, budget, 0, timeout=timeout)


def test_load_recipe_errors(tmp_path) -> None:
    with pytest.raises(RecipeError, match="neither a file nor a preset; presets: .*paper_val_bpb"):
        load_recipe("no_such_recipe")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(RecipeError, match="is not valid JSON"):
        load_recipe(bad)

