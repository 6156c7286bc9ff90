"""Offline selectors as the benchmark runs them: the registry's adapter over ``selection_callbacks.offline.select``.

The library's ``select`` command takes a budget and a config; the benchmark names a method (and a
variant's dotted overrides), passes the tokens its run will train on, and keys its prepare cache on
the method's effective settings. Those three pieces live here, not in the library.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

import yaml

from selection_callbacks.offline.common.corpus import Budget, SelectionError
from selection_callbacks.offline.common.features import FEATURE_VERSION
from selection_callbacks.offline.select import SELECTORS, run_selection


def config_with(config: Any, overrides: Sequence[tuple[str, str]]) -> Any:
    """A copy of a (nested) dataclass config with dotted fields set: ``("bank.proxy_tokens", "null")``.

    Values are YAML scalars (``null``, ``2000000``, ``0.5``, ``hashed``); an unknown field is an
    error naming the fields there are.
    """
    for key, text in overrides:
        head, _, rest = key.partition(".")
        names = [f.name for f in fields(config)]
        if head not in names:
            raise SelectionError(f"{type(config).__name__} has no option {head!r} (from {key!r}); options: {names}")
        value = config_with(getattr(config, head), [(rest, text)]) if rest else yaml.safe_load(text)
        config = dataclasses.replace(config, **{head: value})
    return config


def selector_settings(method: str, overrides: Sequence[tuple[str, str]] = ()) -> str:
    """``method``'s effective config (defaults with ``overrides``) as JSON, and the feature bank's version:
    what a benchmark's cache keys on (a bank computed another way makes other subsets)."""
    config = json.dumps(asdict(config_with(SELECTORS[method].config(), overrides)), sort_keys=True)
    return f"{config} features-v{FEATURE_VERSION}"


def bench_select(
    method: str, pool: str, target: str, budget_tokens: int, seed: int, out_dir: Path,
    overrides: Sequence[tuple[str, str]] = (),
) -> Path:
    """The registry's offline selector signature (:data:`~bench.harness.methods.OfflineSelector`): ``method`` with
    the tokens of a benchmark run.

    The benchmark passes the tokens its run will train on (steps × batch size × seq_len); the
    subset gets ≥ budget_tokens + 1 tokens, so the run reads each selected token about once.
    ``overrides`` set options of the method's config (:func:`config_with`), e.g. a variant
    ``datamask@bank.proxy_tokens=null``.
    """
    if method not in SELECTORS:
        raise SelectionError(f"unknown selection method {method!r}; available: {', '.join(SELECTORS)}")
    config = config_with(SELECTORS[method].config(), overrides)
    out = Path(out_dir) / "subset.parquet"
    run_selection(method, pool, target, Budget(tokens=budget_tokens + 1), seed, out, config, progress=False)
    return out
