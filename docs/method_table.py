"""The README's "choosing a method" table, computed from the committed benchmark results.

    python docs/method_table.py            # rewrite the table between the markers in README.md
    python docs/method_table.py --check    # exit 1 when README.md's table is not this output

Every row is one method on the default corpus under tuned AdamW (cpu-tiny, 2,048,000 update tokens,
ratio 0.5, 3 paired seeds). Per row, from the comparison's ``results.json``:

- Δ: the method's final val bpb minus tuned random's, per seed, averaged; the 95% interval is the paired
  t interval mean ± t₀.₉₇₅,ₙ₋₁ · sd/√n over the seeds;
- its oracle's Δ, from the same comparison: the online oracle (target domains first in each superbatch)
  for online methods, the offline one (target domains first in the whole pool) for offline selectors;
- share: Δ / oracle's Δ;
- step ×: the in-run step-time ratio against random from ``bench.harness.steptime``'s interleaved runs
  (``steptime.json``); an offline selector's training step is random's (1.00), the oracle reads labels;
- wall ×: wall-clock to reach random's final bpb over random's, one-off costs charged:
  step × · (update tokens to random's final bpb / random's tokens) + one-offs / random's run, where the
  one-offs are a reference pretrained when training starts (the timing's fixed seconds above random's)
  or an offline selection (its ``selection_seconds`` over random's wall-clock in the comparison).

The second table, "by model size", reads the ladder's ``bench/results/ladder/ladder.json``
(``bench.harness.ladder``): per online method and rung, Δ with its paired p, the in-run step × and wall-clock to
random's final bpb with one-offs charged (the mean over seeds).

The pool table, which leads, sets the online methods side by side on the three pools at cpu-tiny and 2,048,000
update tokens, each against random tuned on that pool: per cell Δ with its paired p and the update tokens to random's
final bpb over random's (mean of the seeds that reach it), from each pool's ``results.json`` (``POOLS``).

The run-length table reads the horizon report's ``bench/results/horizons/horizons.json`` (``bench.harness.horizons``):
per online method and cell (scale and run length, on the Debian pool), Δ with its paired p, tokens × and wall-clock
to random's final bpb with one-offs charged.

The module reads only ``results.json``, ``steptime.json``, ``ladder.json`` and ``horizons.json`` files under
``bench/results``.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import NamedTuple

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as `python docs/method_table.py`: the bench package is at the repository root
    sys.path.insert(0, str(ROOT))
from bench.harness.intervals import t_half_width  # noqa: E402
from bench.harness.report import fmt_relative, summarize  # noqa: E402

RESULTS = ROOT / "bench" / "results"
START, END = "<!-- method-table:start -->", "<!-- method-table:end -->"
LADDER = "ladder/ladder.json"
HORIZONS = "horizons/horizons.json"
POOLS = (("Debian packages' files", "horizons/cpu-tiny-2M"), ("Python wheels' files", "horizons/packages-cpu-tiny-2M"),
         ("default (with synthetic noise)", "default-adamw"))
"""The pool table's columns, the pool most like users' data first: (label, comparison folder at cpu-tiny, 2M tokens)."""
SIZE_METHODS = (("RHO-LOSS, 16-token windows", "rho@score_len=16"), ("ClassAct", "classact"), ("OPUS", "opus"),
                ("oracle (online)", "oracle"))
HORIZON_METHODS = (SIZE_METHODS[0], ("RHO-LOSS, windows, 1,200 reference steps", "rho@score_len=16@reference_steps=1200"),
                   *SIZE_METHODS[1:])
"""The run-length table's rows: the by-size rows and RHO-LOSS with the longer reference the longest runs add."""
STEPTIMES = ("steptime/cpu-tiny-adamw-inrun", "steptime/cpu-tiny-adamw-loss-inrun")
"""Interleaved step-time runs under tuned AdamW on one host, searched in this order for a method."""


class Row(NamedTuple):
    """One table row: where its runs are and what the method needs."""

    label: str
    comparison: str  # folder under bench/results holding results.json
    method: str  # the method's name in results.json
    offline: bool
    needs: str


ROWS = (
    Row("[RHO-LOSS](selection_callbacks/methods/rho/README.md), 16-token windows", "default-adamw",
        "rho@score_len=16", False, "per-sample loss, target split"),
    Row("[RHO-LOSS](selection_callbacks/methods/rho/README.md)", "default-adamw", "rho", False,
        "per-sample loss, target split"),
    Row("[ClassAct](selection_callbacks/methods/classact/README.md)", "default-adamw", "classact", False,
        "per-sample loss, target split"),
    Row("[GREATS](selection_callbacks/methods/greats/README.md)", "default-adamw", "greats", False,
        "per-sample loss, target rows, SGD/AdamW/Muon"),
    Row("[OPUS](selection_callbacks/methods/opus/README.md)", "default-adamw-rescaled", "opus", False,
        "per-sample loss, target rows, SGD/AdamW/Muon"),
    Row("[high-loss](selection_callbacks/methods/high_loss/README.md)", "default-adamw", "high_loss", False,
        "per-sample loss"),
    Row("[oracle](selection_callbacks/methods/oracle/README.md) (online)", "default-adamw", "oracle", False,
        "domain labels"),
    Row("[DATAMASK](selection_callbacks/offline/datamask/README.md) (offline)", "default-adamw",
        "datamask", True, "pool + target, a proxy pass"),
    Row("[learned policy](selection_callbacks/offline/policy/README.md) (offline)", "default-adamw",
        "policy", True, "pool + target, a proxy pass"),
    Row("[AutoData recipe](selection_callbacks/offline/autodata/README.md) (offline)", "default-adamw",
        "autodata", True, "pool + target, a proxy pass"),
    Row("[DSIR](selection_callbacks/offline/dsir/README.md) (offline)", "default-adamw",
        "dsir", True, "pool + target"),
    Row("[warmup delta](selection_callbacks/offline/warmup_delta/README.md) (offline)", "default-adamw",
        "warmup_delta", True, "pool, a proxy pass"),
    Row("[oracle](selection_callbacks/offline/oracle/README.md) (offline)", "default-adamw",
        "oracle_offline", True, "domain labels"),
)
ORACLE = {False: "oracle", True: "oracle_offline"}


def paired_interval(diffs: list[float]) -> tuple[float, float]:
    """Mean of per-seed differences and the half-width of its 95% paired t interval (nan below 2 seeds)."""
    d = np.asarray(diffs, dtype=float)
    if d.size < 2:
        return float(d.mean()), float("nan")
    return float(d.mean()), t_half_width(d.std(ddof=1) / math.sqrt(d.size), d.size - 1)


def tokens_to(curve: list[list[float]], target: float) -> float | None:
    """Update tokens at which the curve (rows: tokens, wall seconds, val bpb) first reaches ``target``, interpolated."""
    prev = None
    for point in curve:
        if point[2] <= target:
            if prev is None or prev[2] == point[2]:
                return float(point[0])
            return float(prev[0] + (prev[2] - target) / (prev[2] - point[2]) * (point[0] - prev[0]))
        prev = point
    return None


def load(relative: str) -> dict:
    return json.loads((RESULTS / relative).read_text())


def deltas(results: dict, method: str) -> list[float]:
    """Per-seed final val bpb of ``method`` minus random's, over the seeds both ran."""
    base = {r["seed"]: r["final_val_bpb"] for r in results["methods"]["random"]["runs"]}
    return [r["final_val_bpb"] - base[r["seed"]] for r in results["methods"][method]["runs"] if r["seed"] in base]


def step_timing(method: str, timings: list[dict]) -> tuple[float, float]:
    """(in-run step ratio, in-run one-off seconds above random's) of the first timing that holds ``method``."""
    for timing in timings:
        timed = timing["methods"].get(method)
        if timed is not None:
            fixed = timed.get("fixed_seconds_median", 0.0) - timing["methods"]["random"].get("fixed_seconds_median", 0.0)
            random_run = timing["methods"]["random"]["step_ms_median"] / 1000 * 2_048_000 / timing["config"]["tokens_per_step"]
            return float(timed["in_run_ratio_median"]), max(fixed, 0.0) / random_run
    raise KeyError(f"no step timing of {method!r} in {STEPTIMES}")


def wall_to_random(results: dict, method: str, step: float, one_off: float, offline: bool) -> str:
    """Mean wall-clock to random's final bpb over random's, one-offs charged; 'not reached' when a seed never gets there."""
    base = {r["seed"]: r for r in results["methods"]["random"]["runs"]}
    ratios = []
    for run in results["methods"][method]["runs"]:
        random_run = base[run["seed"]]
        tokens = tokens_to(run["curve"], random_run["final_val_bpb"])
        if tokens is None:
            return "not reached"
        selection = run["selection_seconds"] / random_run["wall_seconds"] if offline else one_off
        ratios.append(step * tokens / random_run["curve"][-1][0] + selection)
    return f"{np.mean(ratios):.2f}"


def cells(row: Row, timings: list[dict]) -> list[str]:
    results = load(f"{row.comparison}/results.json")
    mean, half = paired_interval(deltas(results, row.method))
    oracle, _ = paired_interval(deltas(results, ORACLE[row.offline]))
    if row.offline or row.method == "oracle":
        step, one_off = 1.0, 0.0
    else:
        step, one_off = step_timing(row.method, timings)
    link = f"[{mean:+.3f}](bench/results/{row.comparison}/README.md)"
    return [row.label, f"{link} ± {half:.3f}", f"{oracle:+.3f}", f"{mean / oracle:.0%}", f"{step:.2f}",
            wall_to_random(results, row.method, step, one_off, row.offline), row.needs]


def render() -> str:
    """The markdown table, rows in ``ROWS`` order."""
    timings = [load(f"{path}/steptime.json") for path in STEPTIMES]
    lines = [
        "| method | Δ val bpb, 95% CI | its oracle's Δ | share of oracle's gain | step × | "
        "wall-clock to random's bpb × | needs |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    lines += ["| " + " | ".join(cells(row, timings)) + " |" for row in ROWS]
    return "\n".join(lines) + "\n"


def size_cell(cell: dict | None) -> str:
    """``"-0.599 (p < 0.001), 1.28×, 1.34×"``: Δ with its paired p, step × and wall × charged ("–" not measured)."""
    if cell is None:
        return "–"
    step = "–" if cell["step"] is None else f"{cell['step']:.2f}×"
    wall = "–" if not cell["wall_charged"] else f"{np.mean(cell['wall_charged']):.2f}×"
    return f"{cell['diff_mean']:+.3f} ({p_text(cell['p_value'])}), {step}, {wall}"


def render_sizes() -> str:
    """The by-size table from the ladder: a column per rung (smallest first; a rung of another shape after the
    others, with its sequence length and vocabulary), a row per online method."""
    ladder = load(LADDER)
    rungs = ladder["rungs"]
    heads = [f"{r['name']} ({r['params'] / 1e6:.2f}M parameters, {per_param(r['tokens_per_param'])} tokens per parameter" + (
        f", T = {r['learner']['block_size']}, {r['learner']['vocab_size']:,}-token vocabulary: another shape, not a size)"
        if r.get("apart") else ")") for r in rungs]
    lines = ["| method | " + " | ".join(heads) + " |",
             "|---|" + "---:|" * len(rungs)]
    for label, name in SIZE_METHODS:
        lines.append(f"| {label} | " + " | ".join(size_cell(ladder["cells"][r["name"]].get(name)) for r in rungs) + " |")
    return "\n".join(lines) + "\n"


def per_param(tokens_per_param: float) -> str:
    """``"14"`` or, below 10, ``"2.3"``: update tokens per learner parameter, whole from 10 up, one decimal below."""
    return f"{tokens_per_param:.0f}" if tokens_per_param >= 10 else f"{tokens_per_param:.1f}"


def p_text(p: float) -> str:
    """``"p 0.017"``, or ``"p < 0.001"``."""
    return "p < 0.001" if p < 0.001 else f"p {p:.3f}"


def render_pools() -> str:
    """The by-pool table: a column per pool of ``POOLS``, a row per online method of ``SIZE_METHODS``."""
    summaries = [summarize(load(f"{folder}/results.json")) if (RESULTS / folder / "results.json").exists() else {}
                 for _, folder in POOLS]  # a pool not yet measured shows "–"
    lines = ["| method | " + " | ".join(f"[{label}](bench/results/{folder}/README.md)" if summary else label
                                       for (label, folder), summary in zip(POOLS, summaries)) + " |",
             "|---|" + "---:|" * len(POOLS)]
    for label, name in SIZE_METHODS:
        cells = ["–" if name not in summary else f"{summary[name]['diff_mean']:+.3f} ({p_text(summary[name]['p_value'])}), "
                 f"tokens {fmt_relative(summary[name]['tokens_to_random'])}" for summary in summaries]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def render_horizons() -> str:
    """The by-run-length table from the horizon report: a column per cell (by scale, then run length)."""
    report = load(HORIZONS)
    cells = sorted(report["cells"], key=lambda c: (c["params"], c["tokens"]))
    lines = ["| method | " + " | ".join(f"{c['name']}, {c['tokens'] / 1e6:.1f}M tokens ({per_param(c['tokens_per_param'])} per "
                                          "parameter)" for c in cells) + " |",
             "|---|" + "---:|" * len(cells)]
    for label, name in HORIZON_METHODS:
        row = []
        for c in cells:
            r = report["rows"][c["cell"]].get(name)
            row.append("–" if r is None else f"{r['diff_mean']:+.3f} ({p_text(r['p_value'])}), "
                       f"tokens {fmt_relative(r['tokens'])}, wall {fmt_relative(r['wall_charged'])}")
        lines.append(f"| {label} | " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def replaced(text: str, table: str, start: str = START, end: str = END) -> str:
    """``text`` with everything between the markers ``start`` and ``end`` replaced by ``table``."""
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{start}\n{table}{end}{tail}"


TABLES = {"method": render, "size": render_sizes, "pool": render_pools, "horizon": render_horizons}
"""Each README table's name (its markers ``<!-- NAME-table:start -->``/``:end``; the docs' ``<!-- NAME-table -->``)
and the function that renders it."""


def regenerated(text: str) -> str:
    """README.md's text with its four tables rewritten from the results."""
    for name, render_table in TABLES.items():
        text = replaced(text, render_table(), f"<!-- {name}-table:start -->", f"<!-- {name}-table:end -->")
    return text


def main(argv: list[str]) -> int:
    readme = ROOT / "README.md"
    text = readme.read_text()
    new = regenerated(text)
    if "--check" in argv:
        if new != text:
            print("README.md's method tables are stale: run python docs/method_table.py", file=sys.stderr)
            return 1
        return 0
    readme.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
