"""The surrogate model AutoData's evolution proposer screens candidates with: a ridge regression of
trial scores on what each recipe selects.

φ(recipe) is a :class:`SubsetProfile` (the token-weighted mean feature profile of the recipe's subset,
its cluster shares and the share of documents it keeps) or, without a feature table,
:func:`recipe_vector` (the recipe's own parameters). :class:`Ridge` fits scores to φ with its
leave-one-out predictions in closed form; :func:`noise_aware_scores` shrinks each observed score
towards that prediction by how noisy one proxy seed is; :func:`thompson_pick` ranks candidates under
a ridge fitted to a bootstrap resample of the history.

Example::

    profile = SubsetProfile(table, Budget(tokens=2_048_001), seed=0)
    X = np.stack([profile(h["recipe"]) for h in history])
    estimate = noise_aware_scores(X, np.asarray([h["score"] for h in history]), noise_sd=0.065)
"""

from __future__ import annotations

import numpy as np

from selection_callbacks.offline.autodata.evaluation import FeatureTable, apply_recipe_inline, robust_tanh_z
from selection_callbacks.offline.autodata.schema import FEATURES, RULES, RecipeError, canonical
from selection_callbacks.offline.common.corpus import Budget

__all__ = ["Ridge", "SubsetProfile", "noise_aware_scores", "recipe_vector", "thompson_pick"]


def recipe_vector(recipe: dict) -> np.ndarray:
    """φ(recipe) from the recipe's own parameters (the surrogate's inputs when no feature table is at
    hand): per feature the summed signed weight of its plain linear terms and the summed |weight| of
    its other uses (abs, tri, cell, gated); the rule kind (one-hot); the backbone share; centring;
    multiplicative; terms / 4."""
    F = len(FEATURES)
    v = np.zeros(2 * F + len(RULES) + 4)
    terms = recipe.get("terms") or []
    for t in terms:
        j = FEATURES.index(t["feature"])
        w = float(np.clip(t["weight"], -3.0, 3.0))
        plain = t.get("shape", "linear") == "linear" and t.get("aggregate", "doc") == "doc" and "gate" not in t
        v[j if plain else F + j] += w if plain else abs(w)
    v[2 * F + list(RULES).index(recipe.get("rule", {"kind": "top"})["kind"])] = 1.0
    v[-4:] = [recipe.get("backbone", 0.0), recipe.get("centre") is not None,
              recipe.get("combine") == "multiplicative", len(terms) / 4]
    return v


class SubsetProfile:
    """φ(subset) of a term recipe: what the documents it selects look like, cached per recipe.

    The profile is the token-weighted mean over the selected documents of every feature's tanh
    robust z-score (the recipes' own normalisation), the token share of each cluster and the share
    of the pool's documents selected. Recipes with different parameters but similar subsets get
    similar profiles, so a surrogate on profiles carries over between them where one on
    :func:`recipe_vector` sees unrelated points.

    Args:
        table: the search's feature table.
        budget: the search's budget.
        seed: the search's selection seed (the trial's subset is the recipe applied with it).
    """

    def __init__(self, table: FeatureTable, budget: Budget, seed: int) -> None:
        self.table, self.budget, self.seed = table, budget, seed
        self.z = np.stack([robust_tanh_z(table.numeric[f]) for f in FEATURES], axis=1)
        self.cluster = table.categorical["cluster"]
        self.n_clusters = int(self.cluster.max()) + 1
        self.cache: dict[str, np.ndarray | None] = {}

    def __call__(self, recipe: dict) -> np.ndarray | None:
        """The profile of a validated recipe; None for a program recipe or one that fails here."""
        key = canonical(recipe)
        if key not in self.cache:
            self.cache[key] = self._compute(recipe) if "terms" in recipe else None
        return self.cache[key]

    def _compute(self, recipe: dict) -> np.ndarray | None:
        """The profile, uncached."""
        try:
            idx = apply_recipe_inline(recipe, self.table, self.budget, self.seed)
        except RecipeError:
            return None
        w = self.table.n_tokens[idx].astype(np.float64)
        w /= w.sum()
        clusters = np.bincount(self.cluster[idx], weights=w, minlength=self.n_clusters)
        return np.concatenate([w @ self.z[idx], clusters, [idx.size / len(self.table)]])


class Ridge:
    """Ridge regression on standardised inputs, with its leave-one-out predictions.

    Args:
        X: [n, d] inputs.
        y: [n] targets.
        penalty: the ridge penalty λ (in units of standardised inputs).
    """

    def __init__(self, X: np.ndarray, y: np.ndarray, penalty: float) -> None:
        self.mean_x, self.scale_x = X.mean(0), X.std(0) + 1e-9
        self.mean_y = float(y.mean())
        Xs = self._standardise(X)
        inverse = np.linalg.inv(Xs.T @ Xs + penalty * np.eye(X.shape[1]))
        self.beta = inverse @ Xs.T @ (y - self.mean_y)
        self.leverage = np.einsum("ij,jk,ik->i", Xs, inverse, Xs) + 1.0 / len(y)
        self.fitted = self.predict(X)

    def _standardise(self, X: np.ndarray) -> np.ndarray:
        return (X - self.mean_x) / self.scale_x

    def predict(self, X: np.ndarray) -> np.ndarray:
        """Predicted targets of the rows of ``X``."""
        return self._standardise(X) @ self.beta + self.mean_y

    def loo(self, y: np.ndarray) -> np.ndarray:
        """Each training point's prediction by the fit without it (the hat-matrix shortcut)."""
        return y - (y - self.fitted) / np.clip(1.0 - self.leverage, 1e-6, None)


def noise_aware_scores(X: np.ndarray, y: np.ndarray, noise_sd: float, penalty: float = 10.0) -> np.ndarray:
    """Posterior-mean estimates of the trials' true scores: each observed score shrunk towards the
    surrogate's leave-one-out prediction of it, by w = τ² / (τ² + σ²) with σ = ``noise_sd`` (the
    sd of one proxy seed's score) and τ² the leave-one-out residual variance beyond σ² (at least σ²/4).

    A trial that scored far better than trials like it is ranked as partly lucky, so its children
    are not expected to repeat its score."""
    if len(y) < 3:
        return y.astype(np.float64)
    loo = Ridge(X, y, penalty).loo(y)
    tau2 = max(float(np.mean((y - loo) ** 2)) - noise_sd**2, noise_sd**2 / 4)
    return loo + tau2 / (tau2 + noise_sd**2) * (y - loo)


def thompson_pick(candidates: np.ndarray, X: np.ndarray, y: np.ndarray, rng: np.random.Generator,
                  penalty: float = 10.0) -> int:
    """Index of the candidate with the lowest score predicted by a :class:`Ridge` fitted to a
    bootstrap resample of the history (Thompson sampling: the resample is the exploration)."""
    idx = rng.integers(len(y), size=len(y))
    return int(np.argmin(Ridge(X[idx], y[idx], penalty).predict(candidates)))
