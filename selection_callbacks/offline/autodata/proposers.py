"""Who proposes the next AutoData recipe: a random sampler, an evolutionary search, or an agent command.

Every proposer maps (trial history, rng) → a recipe dict; the search validates it like any other,
so a proposer may return anything and a bad proposal becomes a failed trial. Proposals are a
function of the history and the trial's seeded rng only, so a resumed search proposes what the
uninterrupted one would have.

- :class:`RandomProposer`: independent draws from the recipe prior (:func:`random_recipe`).
- :class:`EvolutionProposer`: the presets and the uniform baseline first, then prior draws until
  ``n_init`` trials, then alternately the most promising of many fresh prior draws (explore) and
  of many children of parents ranked by noise-aware estimates (exploit), under a ridge surrogate
  on the subsets' feature profiles fitted to a bootstrap resample of the trials so far
  (:mod:`~selection_callbacks.offline.autodata.surrogate`); never a recipe already tried.
- :class:`AgentProposer`: runs a user command (an LLM agent, AIDE-style). It receives on stdin
  ``{"trial", "history", "features", "categorical", "rules", "schema", "presets", "budget"}`` as
  JSON and must print one recipe as JSON on stdout (size-capped; inline ``code`` only, never a
  ``program`` path).
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any, Callable, Protocol

import numpy as np

from selection_callbacks.offline.autodata import schema
from selection_callbacks.offline.autodata.agent_io import ProposalError, parse_recipe, run_agent
from selection_callbacks.offline.autodata.sandbox.runner import truncate
from selection_callbacks.offline.autodata.schema import (
    CATEGORICAL,
    FEATURES,
    PRESET_DIR,
    RULE_DEFAULTS,
    RULES,
    RecipeError,
    canonical,
    load_recipe,
    validate_recipe,
)
from selection_callbacks.offline.autodata.surrogate import noise_aware_scores, recipe_vector, thompson_pick

__all__ = [
    "AgentProposer", "EvolutionProposer", "MAX_TERMS", "POSITIVE_SKEWED", "ProposalError", "Proposer", "RandomProposer",
    "crossover", "make_proposer", "merge_terms", "mutate", "presets", "random_recipe", "random_rule", "random_term",
]

POSITIVE_SKEWED = ("n_bytes", "n_tokens", "bos_per_seq")
MAX_TERMS = 4


class Proposer(Protocol):
    name: str

    def propose(self, history: list[dict[str, Any]], trial: int, rng: np.random.Generator) -> dict:
        """The recipe of trial ``trial`` given the finished trials (their records, in trial order)."""
        ...


def presets() -> dict[str, dict]:
    """The paper's recipes shipped as ``presets/paper_*.json`` (package data), by file stem."""
    return {p.stem: load_recipe(p) for p in sorted(PRESET_DIR.glob("paper_*.json"))}


# ---------------------------------------------------------------- the recipe prior


def random_term(rng: np.random.Generator, gate: bool = True) -> dict:
    feature = str(rng.choice(FEATURES))
    t: dict[str, Any] = {"feature": feature, "weight": round(float(rng.normal(0.0, 1.0)), 3)}
    if feature in POSITIVE_SKEWED and rng.random() < 0.7:
        t["transform"] = "log"
    shape = str(rng.choice(["linear", "abs", "tri"], p=[0.7, 0.15, 0.15]))
    if shape != "linear":
        t["shape"] = shape
    if shape == "tri":
        t["centre"], t["width"] = round(float(rng.uniform(-0.8, 0.8)), 3), round(float(rng.uniform(0.3, 1.5)), 3)
    if rng.random() < 0.1:
        t["aggregate"] = "cell"
    if gate and rng.random() < 0.15:
        t["gate"] = [{"feature": str(rng.choice(FEATURES)), "weight": float(rng.choice([-1.0, 1.0]))}]
    return t


def random_rule(rng: np.random.Generator) -> dict:
    kind = str(rng.choice(list(RULES)))
    r: dict[str, Any] = {"kind": kind}
    if kind == "threshold":
        r["quantile"] = round(float(rng.uniform(0.1, 0.9)), 3)
    elif kind == "gumbel":
        r["temperature"] = round(float(math.exp(rng.uniform(math.log(0.05), math.log(5.0)))), 4)
    elif kind == "tournament":
        r["slate"], r["temperature"] = int(rng.integers(2, 9)), round(float(rng.uniform(0.0, 1.0)), 3)
    elif kind == "quota":
        r["alpha"], r["temperature"] = round(float(rng.uniform(0.0, 1.0)), 3), round(float(rng.uniform(0.0, 0.5)), 3)
    return r


def random_recipe(rng: np.random.Generator, name: str = "random") -> dict:
    """A draw from the prior: 1–4 terms, linear (70%) or multiplicative, optional centring, any rule,
    no backbone (40%) or a backbone share in [0, 0.6]."""
    return {
        "name": name,
        "terms": [random_term(rng) for _ in range(int(rng.integers(1, 5)))],
        "combine": "linear" if rng.random() < 0.7 else "multiplicative",
        "cells": [str(c) for c in rng.choice(CATEGORICAL, size=int(rng.integers(1, 3)), replace=False)],
        "centre": {"shrinkage": round(float(math.exp(rng.uniform(0.0, math.log(100.0)))), 2)} if rng.random() < 0.3 else None,
        "rule": random_rule(rng),
        "backbone": 0.0 if rng.random() < 0.4 else round(float(rng.uniform(0.0, 0.6)), 3),
    }


# ---------------------------------------------------------------- mutation


def mutate(recipe: dict, rng: np.random.Generator) -> dict:
    """One random edit of a (validated, term) recipe."""
    r = copy.deepcopy(recipe)
    terms = r["terms"]
    ops = ["weight", "weight", "sign", "add", "drop", "shape", "gate", "rule", "rule_param", "backbone", "centre",
           "combine", "cells"]
    op = str(rng.choice(ops))
    if not terms:
        op = "add"
    elif op == "add" and len(terms) >= MAX_TERMS:
        op = "drop"  # parsimony: children do not outgrow the prior's largest recipes
    k = int(rng.integers(len(terms))) if terms else 0
    if op == "weight":
        terms[k]["weight"] = round(terms[k]["weight"] * float(math.exp(rng.normal(0, 0.5))) + float(rng.normal(0, 0.2)), 3)
    elif op == "sign":
        terms[k]["weight"] = -terms[k]["weight"]
    elif op == "add" or (op == "drop" and len(terms) < 2):
        terms.append(random_term(rng))
    elif op == "drop":
        terms.pop(k)
    elif op == "shape":
        fresh = random_term(rng, gate=False)
        for key in ("shape", "centre", "width"):
            terms[k].pop(key, None)
            if key in fresh:
                terms[k][key] = fresh[key]
    elif op == "gate":
        if "gate" in terms[k]:
            terms[k].pop("gate")
        else:
            terms[k]["gate"] = [{"feature": str(rng.choice(FEATURES)), "weight": float(rng.choice([-1.0, 1.0]))}]
    elif op == "rule":
        r["rule"] = random_rule(rng)
    elif op == "rule_param":
        kind = r["rule"]["kind"]
        for key, (lo, hi) in RULES[kind].items():
            value = r["rule"].get(key, RULE_DEFAULTS[kind][key])
            if key == "slate":
                value = int(np.clip(value + rng.choice([-1, 1]), lo, min(hi, 16)))
            else:
                value = float(np.clip(value * math.exp(rng.normal(0, 0.5)) + rng.normal(0, 0.05), lo, hi))
                value = round(value, 4)
            r["rule"][key] = value
        if not RULES[kind]:
            r["rule"] = random_rule(rng)
    elif op == "backbone":
        r["backbone"] = round(float(np.clip(r["backbone"] + rng.normal(0, 0.15), 0.0, 0.9)), 3)
        if r["backbone"] < 0.03:
            r["backbone"] = 0.0
    elif op == "centre":
        r["centre"] = None if r["centre"] else {"shrinkage": round(float(math.exp(rng.uniform(0.0, math.log(100.0)))), 2)}
    elif op == "combine":
        r["combine"] = "multiplicative" if r["combine"] == "linear" else "linear"
    elif op == "cells":
        r["cells"] = [str(c) for c in rng.choice(CATEGORICAL, size=int(rng.integers(1, 3)), replace=False)]
    return r


def crossover(a: dict, b: dict, rng: np.random.Generator) -> dict:
    """Terms drawn from both parents (each kept with probability ½, at least one, at most MAX_TERMS),
    the rest from one parent."""
    pool = copy.deepcopy(a["terms"] + b["terms"])
    keep = [t for t in pool if rng.random() < 0.5] or [pool[int(rng.integers(len(pool)))]]
    child = copy.deepcopy(a if rng.random() < 0.5 else b)
    child["terms"] = merge_terms(keep)[:MAX_TERMS]
    return child


def merge_terms(terms: list[dict]) -> list[dict]:
    """Terms that differ only in weight become one term with the summed weight."""
    merged: dict[str, dict] = {}
    for t in terms:
        key = json.dumps({k: v for k, v in t.items() if k != "weight"}, sort_keys=True)
        if key in merged:
            merged[key]["weight"] = round(merged[key]["weight"] + t["weight"], 3)
        else:
            merged[key] = copy.deepcopy(t)
    return list(merged.values())


class RandomProposer:
    """Independent draws from the recipe prior (the uniform baseline first, so scores share a reference)."""

    name = "random"

    def propose(self, history: list[dict[str, Any]], trial: int, rng: np.random.Generator) -> dict:
        if trial == 0:
            return load_recipe("uniform")
        return random_recipe(rng, name=f"random-{trial}")


class EvolutionProposer:
    """Surrogate-screened search in two alternating arms.

    First the seeds (uniform, the paper's presets), then prior draws until ``n_init`` trials. After
    that, trials alternate between

    - *explore* (trials n_init, n_init + 2, …): the most promising of ``screen_prior`` fresh prior
      draws, so half the search keeps the prior's breadth (the best of many independent draws is
      what a random proposer's strength is), screened away from subsets like the bad ones;
    - *exploit* (the others): the most promising of ``screen`` novel children (crossover with
      probability ``p_crossover``, then 1–2 mutations) of parents chosen by tournament on
      :func:`noise_aware_scores`, not on the raw scores, so a parent that was lucky under the one
      proxy seed is discounted.

    "Most promising" is :func:`thompson_pick` with a ridge surrogate on ``profile`` (a
    :class:`SubsetProfile` when the search passes its feature table) or, without one, on
    :func:`recipe_vector`. Never proposes a recipe already tried.

    Args:
        n_init: trials before the arms start (the seeds count towards it).
        tournament: parents are the best of this many successful term trials drawn at random.
        p_crossover: share of children made by crossover before mutation.
        screen: children per exploit proposal ranked by the surrogate.
        screen_prior: prior draws per explore proposal ranked by the surrogate.
        noise_sd: sd of a trial's score under one proxy seed, in bpb (the default is the default corpus's;
            set it to your pool's, from the scores of one recipe under a few proxy seeds).
        seed_presets: run the paper's presets right after the uniform recipe (they then compete
            as parents); False leaves them out of the search.
        profile: recipe → surrogate input (None when the recipe cannot be profiled); None =
            :func:`recipe_vector`.
    """

    name = "evolution"

    def __init__(self, n_init: int = 8, tournament: int = 3, p_crossover: float = 0.2, screen: int = 64,
                 screen_prior: int = 16, noise_sd: float = 0.065, seed_presets: bool = True,
                 profile: Callable[[dict], np.ndarray | None] | None = None) -> None:
        if screen < 1 or screen_prior < 1:
            raise ValueError(f"screen and screen_prior must be ≥ 1, got {screen} and {screen_prior}")
        self.n_init, self.tournament, self.p_crossover = n_init, tournament, p_crossover
        self.screen, self.screen_prior, self.noise_sd = screen, screen_prior, noise_sd
        self.profile = profile or recipe_vector
        self.seeds = [load_recipe("uniform"), *(presets().values() if seed_presets else [])]

    def propose(self, history: list[dict[str, Any]], trial: int, rng: np.random.Generator) -> dict:
        if trial < len(self.seeds):
            return self.seeds[trial]
        if trial < self.n_init:
            return random_recipe(rng, name=f"random-{trial}")
        profiled = [(h, self.profile(h["recipe"])) for h in history
                    if h["status"] == "ok" and h["recipe"] and "terms" in h["recipe"]]
        scored = [h for h, v in profiled if v is not None]
        if len(scored) < 2:
            return random_recipe(rng, name=f"random-{trial}")
        X = np.stack([v for _, v in profiled if v is not None])
        y = np.asarray([h["score"] for h in scored])
        seen = {canonical(h["recipe"]) for h in history if h.get("recipe")}
        if (trial - self.n_init) % 2 == 0:
            candidates = self._novel(lambda: validate_recipe(random_recipe(rng, name=f"random-{trial}")),
                                     self.screen_prior, seen)
        else:
            estimate = noise_aware_scores(X, y, self.noise_sd)
            parents = [(h, e) for h, e in zip(scored, estimate) if h["recipe"]["terms"]]
            candidates = self._novel(lambda: self._child(parents, trial, rng), self.screen, seen) if parents else []
        if not candidates:
            return random_recipe(rng, name=f"random-{trial}")
        if len(candidates) == 1:
            return candidates[0][0]
        return candidates[thompson_pick(np.stack([v for _, v in candidates]), X, y, rng)][0]

    def _novel(self, draw: Callable[[], dict | None], n: int, seen: set[str]) -> list[tuple[dict, np.ndarray]]:
        """Up to ``n`` untried recipes from ``draw`` (20·n attempts) with their profiles."""
        out: list[tuple[dict, np.ndarray]] = []
        for _ in range(20 * n):
            if len(out) == n:
                break
            recipe = draw()
            key = None if recipe is None else canonical(recipe)
            if key is None or key in seen:
                continue
            seen.add(key)
            v = self.profile(recipe)
            if v is not None:
                out.append((recipe, v))
        return out

    def _child(self, parents: list[tuple[dict[str, Any], float]], trial: int, rng: np.random.Generator) -> dict | None:
        def parent() -> dict:
            picks = rng.choice(len(parents), size=min(self.tournament, len(parents)), replace=False)
            return min((parents[int(i)] for i in picks), key=lambda p: p[1])[0]

        first = parent()
        child = crossover(first["recipe"], parent()["recipe"], rng) if rng.random() < self.p_crossover else first["recipe"]
        for _ in range(int(rng.integers(1, 3))):
            child = mutate(child, rng)
        try:
            return validate_recipe({**child, "name": f"child-{trial}-of-{first['trial']}"})
        except RecipeError:
            return None


class AgentProposer:
    """Runs ``command`` (a shell command) with the search state as JSON on stdin; reads one recipe from stdout.

    The answer is read up to ``max_bytes`` (a longer one kills the command and fails the proposal)
    and must be one JSON object; a recipe naming a ``program`` file is refused (an agent gives
    inline ``code``, which runs in the sandbox). The errors of earlier trials reach the agent cut to
    :data:`~selection_callbacks.offline.autodata.sandbox.runner.MESSAGE_CHARS` characters. The command's
    stderr is appended to ``stderr_log`` (when given) for the user.

    Args:
        command: e.g. ``"python my_agent.py"``; it sees ``{"trial", "history", "features", ...}``.
        timeout: seconds the command may take.
        context: extra fields of the payload (feature statistics, the budget).
        max_bytes: the most the command may print on stdout.
        stderr_log: file the command's stderr is appended to, a header per trial.
    """

    name = "agent"

    def __init__(self, command: str, timeout: float = 300.0, context: dict[str, Any] | None = None,
                 max_bytes: int = 1 << 20, stderr_log: Path | None = None) -> None:
        if not command.strip():
            raise ValueError("the agent proposer needs a command")
        self.command, self.timeout, self.context = command, timeout, context or {}
        self.max_bytes, self.stderr_log = max_bytes, stderr_log
        self.presets = presets()

    def payload(self, history: list[dict[str, Any]], trial: int) -> dict[str, Any]:
        return {
            "trial": trial,
            "history": [{**h, "error": truncate(h["error"])} if h.get("error") else h for h in history],
            "features": list(FEATURES),
            "categorical": list(CATEGORICAL),
            "rules": {k: list(v) for k, v in RULES.items()},
            "schema": schema.__doc__,
            "presets": self.presets,
            **self.context,
        }

    def propose(self, history: list[dict[str, Any]], trial: int, rng: np.random.Generator) -> dict:
        answer = run_agent(self.command, json.dumps(self.payload(history, trial)).encode(), self.timeout,
                           self.max_bytes, self.stderr_log, f"trial {trial}")
        return parse_recipe(answer)


def make_proposer(name: str, agent_command: str | None = None, agent_timeout: float = 300.0,
                  context: dict[str, Any] | None = None, n_init: int = 8, seed_presets: bool = True,
                  profile: Callable[[dict], np.ndarray | None] | None = None, agent_max_bytes: int = 1 << 20,
                  agent_log: Path | None = None) -> Proposer:
    """``random`` | ``evolution`` (``n_init``, ``seed_presets``, ``profile``) | ``agent`` (needs
    ``agent_command``; ``agent_max_bytes`` caps its answer, ``agent_log`` keeps its stderr)."""
    if name == "random":
        return RandomProposer()
    if name == "evolution":
        return EvolutionProposer(n_init=n_init, seed_presets=seed_presets, profile=profile)
    if name == "agent":
        if not agent_command:
            raise ValueError("--proposer agent needs --agent-command, the command that prints a recipe")
        return AgentProposer(agent_command, agent_timeout, context, agent_max_bytes, agent_log)
    raise ValueError(f"unknown proposer {name!r}; available: random, evolution, agent")
