"""The benchmark's method registry: one line per landed method.

An *online* method is a ``configs/method/<name>.yaml`` (its selection callback) trained from the
full pool, after an optional once-per-seed ``prepare`` stage whose seconds are a one-off cost (a
reference loss table). An *offline* method is a selector ``(pool, target, budget_tokens, seed, out_dir) -> subset
file`` run once per seed in a cached prepare stage; its run trains on that subset (ratio 1, every
candidate kept) and its selection seconds are added to its wall-clock.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from bench.harness.offline import bench_select, selector_settings
from bench.harness.reference_table import rho_reference_table

OfflineSelector = Callable[..., Path]
"""``(pool, target, budget_tokens, seed, out_dir[, overrides]) -> subset file``."""

OnlinePrepare = Callable[..., list[tuple[str, str]]]
"""``(pool, target, val, scale, method_config, seed, out_dir, threads, variant overrides) -> selection overrides``."""


@dataclass(frozen=True)
class Method:
    """A benchmark entry.

    Attributes:
        name: the ``--methods`` name.
        config: online: path of its method YAML (relative to the repository root).
        select: offline: the selector that writes a subset file.
        inputs: offline: files (relative to the repository root) the selector reads besides the
            data, e.g. a recipe; their text is part of the method's identity.
        settings: offline: overrides → the selector's effective config as text, part of the
            method's identity (a changed default reselects instead of reusing a stale subset).
        prepare: online: a once-per-seed stage (cached, its seconds charged to the run as a one-off cost)
            whose returned selection overrides the run trains with.
        family: the plot a report draws it in (beside random and both oracles): ``loss`` (scores
            from losses), ``gradient`` (scores from per-sample gradients), ``offline`` (a subset
            chosen before training), ``reference`` (random and the oracles, on every plot).
    """

    name: str
    config: str | None = None
    select: OfflineSelector | None = None
    inputs: tuple[str, ...] = ()
    settings: Callable[[list[tuple[str, str]]], str] | None = None
    prepare: OnlinePrepare | None = None
    family: str = "offline"

    @property
    def offline(self) -> bool:
        return self.select is not None


REGISTRY: dict[str, Method] = {
    "random": Method("random", config="configs/method/random.yaml", family="reference"),
    "high_loss": Method("high_loss", config="configs/method/high_loss.yaml", family="loss"),
    "oracle": Method("oracle", config="configs/method/oracle.yaml", family="reference"),
    "opus": Method("opus", config="configs/method/opus.yaml", family="gradient"),
    "opus_greedy": Method("opus_greedy", config="configs/method/opus_greedy.yaml", family="gradient"),
    "greats": Method("greats", config="configs/method/greats.yaml", family="gradient"),
    # the rho and classact references are pretrained on the target split at the start of each run
    "rho": Method("rho", config="configs/method/rho.yaml", family="loss"),
    # the same reference built once per seed before the run and its pool losses looked up (bench/harness/reference_table.py)
    "rho_lookup": Method("rho_lookup", config="configs/method/rho.yaml", prepare=rho_reference_table, family="loss"),
    "classact": Method("classact", config="configs/method/classact.yaml", family="loss"),
    "classact_report": Method("classact_report", config="configs/method/classact_report.yaml", family="loss"),
    # offline: the subset holds the tokens the run trains on (selection_callbacks.offline.select)
    "dsir": Method("dsir", select=partial(bench_select, "dsir"), settings=partial(selector_settings, "dsir")),
    "warmup_delta": Method("warmup_delta", select=partial(bench_select, "warmup_delta"), settings=partial(selector_settings, "warmup_delta")),
    "policy": Method("policy", select=partial(bench_select, "policy"), settings=partial(selector_settings, "policy")),
    "datamask": Method("datamask", select=partial(bench_select, "datamask"), settings=partial(selector_settings, "datamask")),
    # the offline labelled oracle: the ceiling offline methods are measured against
    "oracle_offline": Method("oracle_offline", select=partial(bench_select, "oracle"),
                             settings=partial(selector_settings, "oracle"), family="reference"),
    # the recipe exported by the AutoData search (bench/results/autodata), applied with each seed
    "autodata": Method(
        "autodata", select=partial(bench_select, "autodata"),
        inputs=("selection_callbacks/offline/autodata/presets/autodata_best.json",),
        settings=partial(selector_settings, "autodata"),
    ),
}


def resolve(names: list[str]) -> list[Method]:
    """Methods by name; an unknown name is an error listing the available ones."""
    out = []
    for name in names:
        if name not in REGISTRY:
            raise SystemExit(f"method {name!r} is unknown; available: {', '.join(REGISTRY)}")
        out.append(REGISTRY[name])
    if "random" not in [m.name for m in out]:
        raise SystemExit("the comparison is against random selection: include 'random' in --methods")
    return out
