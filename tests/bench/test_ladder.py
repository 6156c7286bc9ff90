"""bench.harness.ladder: paired Δ, intervals, trends and parameter counts across rungs, on small synthetic files."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import yaml
from scipy import stats

from bench.harness import ladder
from selection_callbacks.nn.gpt import GPT

SCALE = {"model": {"config": {"n_layer": 2, "n_head": 2, "n_embd": 64, "vocab_size": 320}},
         "data": {"seq_len": 128, "batch_size": 16}}
TOKENS = 2_048_000


def _run(seed: int, final: float) -> dict:
    """A run whose val bpb falls linearly from 4.0 to ``final`` over the update tokens (random's wall: 100 s)."""
    curve = [[t, 100.0 * t / TOKENS, 4.0 + (final - 4.0) * t / TOKENS] for t in np.linspace(0, TOKENS, 5)]
    return {"seed": seed, "final_val_bpb": final, "curve": curve, "wall_seconds": 100.0, "one_off_seconds": 0.0}


def _results(finals: dict[str, list[float]], width: int) -> dict:
    scale = {**SCALE, "model": {"config": {**SCALE["model"]["config"], "n_embd": width}}}
    return {"config": {"scale": yaml.safe_dump(scale), "tokens": TOKENS, "optimizer": "adamw"},
            "methods": {name: {"runs": [_run(s, f) for s, f in enumerate(v)]} for name, v in finals.items()}}


def _timed(in_run: list[float], modelled: float, parts: dict) -> dict:
    return {"in_run_ratios": in_run, "in_run_ratio_median": float(np.median(in_run)), "ratios": in_run,
            "modelled_ratio": modelled, "modelled_parts": parts, "step_ms_median": 100.0, "fixed_seconds_median": 0.0}


STEPTIME = {"config": {"optimizer": "adamw", "scale": "mini", "tokens_per_step": 2048},
            "methods": {"random": _timed([1.0, 1.0, 1.0], 1.0, {}),
                        "rho@score_len=16": _timed([1.10, 1.12, 1.30], 1.127,
                                                   {"learner_fwd": 0.083, "reference_fwd": 0.044}),
                        "classact": _timed([2.5, 2.5, 2.6], 2.2,
                                           {"online_fwd": 0.5, "online_bwd": 0.35, "reference_fwd": 0.35})}}
FINALS = {"random": [3.60, 3.65, 3.70], "oracle": [3.50, 3.52, 3.61], "rho@score_len=16": [3.10, 3.21, 3.18],
          "classact": [3.00, 3.30, 3.05]}


def test_paired_cell_matches_scipy() -> None:
    cell = ladder.paired_cell(_results(FINALS, 64), "rho@score_len=16")
    d = np.array(FINALS["rho@score_len=16"]) - np.array(FINALS["random"])
    assert cell["diffs"] == pytest.approx(d) and cell["diff_mean"] == pytest.approx(d.mean())
    assert cell["p_value"] == pytest.approx(stats.ttest_rel(FINALS["rho@score_len=16"], FINALS["random"]).pvalue)
    assert cell["ci"] == pytest.approx(stats.t.interval(0.95, 2, loc=d.mean(), scale=stats.sem(d)))
    assert ladder.paired_cell(_results(FINALS, 64), "opus") is None


def test_trend_matches_polyfit_and_linregress() -> None:
    x = [5.2, 5.2, 5.2, 5.9, 5.9, 5.9, 6.4, 6.4, 6.4]
    y = [-0.8, -0.75, -0.9, -0.7, -0.72, -0.6, -0.5, -0.55, -0.45]
    t, fit = ladder.trend(x, y), stats.linregress(x, y)
    assert t["slope"] == pytest.approx(np.polyfit(x, y, 1)[0]) and t["se"] == pytest.approx(fit.stderr)
    half = stats.t.ppf(0.975, len(x) - 2) * fit.stderr
    assert t["ci"] == pytest.approx((fit.slope - half, fit.slope + half))
    assert math.isnan(ladder.trend([5.2, 5.2], [0.1, 0.2])["slope"])  # one size: no slope


def test_count_params_matches_a_built_gpt() -> None:
    config = ladder.learner_config(SCALE)
    assert config.block_size == 128
    assert ladder.count_params(config) == sum(p.numel() for p in GPT(config).parameters())


def test_report_across_rungs(tmp_path) -> None:
    """Two rungs, the larger without a step-time file: its step and equal-wall columns read "not measured"; the
    check flags a loss method off by more than 0.1; the recommendation heading stays empty."""
    paths = {}
    for name, width in (("mini", 64), ("small", 128)):
        paths[name] = tmp_path / f"{name}.json"
        paths[name].write_text(json.dumps(_results(FINALS, width)))
    (tmp_path / "steptime.json").write_text(json.dumps(STEPTIME))
    report = ladder.main(["--methods", "random,oracle,rho@score_len=16,classact", "--out", str(tmp_path / "out"),
                          "--rung", f"small={paths['small']}",
                          "--rung", f"mini={paths['mini']}:{tmp_path / 'steptime.json'}"])
    text = (tmp_path / "out" / "report.md").read_text()
    assert [r["name"] for r in report["rungs"]] == ["mini", "small"]  # ordered by size
    row = next(line for line in text.splitlines() if line.startswith("| rho@score_len=16 | small |"))
    assert row.count("not measured") == 3
    assert "| mini | classact | 2.200 | not measured | 2.500 | +0.300 |" in text and "**exceeds 0.1**" in text
    assert "| mini | rho@score_len=16 | 1.127 | not measured | 1.120 | -0.007 |" in text and "within 0.1" in text
    assert text.rstrip().endswith("leaves it empty. -->") and "## Which method at which size" in text
    assert report["trends"]["rho@score_len=16"]["delta"]["rungs"] == 2
    assert report["trends"]["rho@score_len=16"]["step"]["rungs"] == 1
    assert {p.name for p in (tmp_path / "out").glob("*.png")} == {f for f, *_ in ladder.PLOTS.values()}
    projected = report["projection"]["methods"]
    assert set(projected["rho@score_len=16"]) == {"mini"} and projected["oracle"] == {}
    assert "| oracle | | | no rung timed it |" in text
    rho = projected["rho@score_len=16"]["mini"]  # the sensitivity charges the proxy's part 4×, the learner's once
    assert rho["proxy_share"] > 0
    assert rho["slow_proxies"] == pytest.approx(rho["attention"] + (ladder.PROXY_SLOWDOWN - 1) * rho["proxy_share"])
    assert rho["slow_proxies"] > rho["attention"] > 1
    saved = json.loads((tmp_path / "out" / "ladder.json").read_text())
    oracle = np.mean(np.array(FINALS["oracle"]) - np.array(FINALS["random"]))
    assert saved["cells"]["small"]["rho@score_len=16"]["oracle_diff"] == pytest.approx(oracle)
    assert saved["rungs"][0]["tokens_per_param"] == pytest.approx(TOKENS / saved["rungs"][0]["params"])
    timing = {"methods": {"classact": {"ratio": 2.45}, "rho@score_len=16": {"ratio": 1.30}}}
    (tmp_path / "pass_timing.json").write_text(json.dumps(timing))  # the check then holds the calibrated ratio
    ladder.main(["--methods", "random,rho@score_len=16,classact", "--out", str(tmp_path / "out"),
                 "--rung", f"mini={paths['mini']}:{tmp_path / 'steptime.json'}"])
    text = (tmp_path / "out" / "report.md").read_text()
    assert "| mini | classact | 2.200 | 2.450 | 2.500 | +0.050 |" in text
    assert "| mini | rho@score_len=16 | 1.127 | 1.300 | 1.120 | -0.180 |" in text and "**exceeds 0.1**" in text
    assert "the gap is not split" in text
    # OPUS's gap split into its selection's parts: the terms add up to measured − calibrated
    steptime = {**STEPTIME, "methods": {**STEPTIME["methods"], "opus": _timed(
        [1.5, 1.5, 1.5], 1.32, {"learner_fwd": 0.107, "learner_reached_bwd": 0.215})}}
    (tmp_path / "steptime.json").write_text(json.dumps(steptime))
    timing["methods"]["opus"] = {"ratio": 1.26}
    (tmp_path / "pass_timing.json").write_text(json.dumps(timing))
    shares = {"forward": 0.10, "backward": 0.15, "utilities": 0.05, "maps": 0.08, "grouping": 0.01, "collect": 0.01,
              "step_maps": 0.02, "windows": 0.01, "calibrate": 0.01, "sampling": 0.03, "rest": 0.03}
    parts = {"methods": {"opus": {"shares": shares, "counted_share": 0.30, "left_out_share": 0.20,
                                  "calibrated_share": 0.27, "random_selection_seconds": 0.001, "base_seconds": 0.1}}}
    (tmp_path / "ghost_parts.json").write_text(json.dumps(parts))
    report = ladder.main(["--methods", "random,opus", "--out", str(tmp_path / "out"),
                          "--rung", f"mini={paths['mini']}:{tmp_path / 'steptime.json'}"])
    text = (tmp_path / "out" / "report.md").read_text()
    # 1.50 − 1.26 = 0.24 = (0.30 − 0.27) + 0.20 − 0.01 + the other processes' 0.02
    assert "| mini | opus | +0.240 | +0.030 | +0.200 | 0.010 | +0.020 | 0.080 | 0.010 | 0.010 | 0.020 |" in text
    row = report["gap_parts"][0]
    assert row["passes"] + row["left_out_total"] - row["random_selection"] + row["other_processes"] == pytest.approx(0.24)
    with pytest.raises(SystemExit, match="timed scale mini, not small"):  # a timing of another rung is refused
        ladder.load_rung(f"small={paths['small']}:{tmp_path / 'steptime.json'}")


def test_a_rung_apart_stands_in_the_tables_and_out_of_the_trends(tmp_path) -> None:
    """--apart long: its rows follow the others' whatever its size, marked, and the trends fit the other two rungs
    alone (the slope they give without it); an --apart that names no rung is refused."""
    paths = {}
    for name, width, shift in (("mini", 64, 0.0), ("small", 128, 0.1), ("long", 96, -0.5)):
        finals = {k: [f + (shift if k != "random" else 0.0) for f in v] for k, v in FINALS.items()}
        if name == "long":  # a variant only the long rung ran
            finals["rho@score_len=16@reference_steps=75"] = finals["rho@score_len=16"]
        paths[name] = tmp_path / f"{name}.json"
        paths[name].write_text(json.dumps(_results(finals, width)))
    rungs = [f"{name}={paths[name]}" for name in ("long", "small", "mini")]
    both = ladder.main(["--methods", "random,rho@score_len=16", "--out", str(tmp_path / "two"),
                        "--rung", rungs[1], "--rung", rungs[2]])
    report = ladder.main(["--methods", "random,rho@score_len=16,rho@score_len=16@reference_steps=75", "--out",
                          str(tmp_path / "out"), "--apart", "long",
                          *[arg for rung in rungs for arg in ("--rung", rung)]])
    assert [(r["name"], r["apart"]) for r in report["rungs"]] == [("mini", False), ("small", False), ("long", True)]
    delta = report["trends"]["rho@score_len=16"]["delta"]
    assert (delta["slope"], delta["n"], delta["rungs"]) == (both["trends"]["rho@score_len=16"]["delta"]["slope"], 6, 2)
    text = (tmp_path / "out" / "report.md").read_text()
    assert "| rho@score_len=16 | long (apart) |" in text and "Apart: long, of another shape" in text
    assert "| rho@score_len=16@reference_steps=75 | long (apart) |" in text  # its one row: no "not run" rows
    assert "| rho@score_len=16@reference_steps=75 | mini |" not in text
    assert "| rho@score_len=16@reference_steps=75 | – (0 points" not in text  # and no trend
    assert report["cells"]["long"]["rho@score_len=16"]["diff_mean"] == pytest.approx(
        np.mean(np.array(FINALS["rho@score_len=16"]) - 0.5 - np.array(FINALS["random"])))
    with pytest.raises(SystemExit, match=r"--apart \['short'\]: no --rung has that name"):
        ladder.main(["--methods", "random,rho@score_len=16", "--out", str(tmp_path / "x"), "--apart", "short",
                     "--rung", rungs[2]])


def test_method_shape_reads_windows_and_proxies() -> None:
    """The projection's inputs come from the method configs: windows from score_len (rho's default: whole
    sequences), proxies from proxy_layers × proxy_width (OPUS has none)."""
    learner = ladder.learner_config(SCALE)
    shapes = {name: ladder.method_shape(name, learner, 128) for name in ("rho", "rho@score_len=16", "classact", "opus")}
    assert {name: window for name, (_, window) in shapes.items()} == {"rho": None, "rho@score_len=16": 16,
                                                                      "classact": None, "opus": 16}
    assert (shapes["classact"][0].proxy.n_layer, shapes["classact"][0].proxy.n_embd) == (2, 128)
    assert shapes["opus"][0].proxy is None and shapes["rho"][0].proxy.vocab_size == learner.vocab_size
