"""bench.harness.horizons: token multipliers, derived reference timings and the verdicts, on small synthetic files."""

from __future__ import annotations

import json

import numpy as np
import pytest
import yaml

from bench.harness import horizons

SCALE = {"model": {"config": {"n_layer": 2, "n_head": 2, "n_embd": 64, "vocab_size": 320}},
         "data": {"seq_len": 128, "batch_size": 16}}


def _run(seed: int, final: float, tokens: int) -> dict:
    """A run whose val bpb falls linearly from 4.0 to ``final`` over its update tokens (wall: 100 s)."""
    curve = [[t, 100.0 * t / tokens, 4.0 + (final - 4.0) * t / tokens] for t in np.linspace(0, tokens, 5)]
    return {"seed": seed, "final_val_bpb": final, "curve": curve, "wall_seconds": 100.0, "one_off_seconds": 0.0}


def _results(finals: dict[str, list[float]], tokens: int) -> dict:
    return {"config": {"scale": yaml.safe_dump(SCALE), "tokens": tokens, "optimizer": "adamw"},
            "methods": {name: {"runs": [_run(s, f, tokens) for s, f in enumerate(v)]} for name, v in finals.items()}}


def _timed(ratio: float, startup: float) -> dict:
    return {"in_run_ratios": [ratio] * 3, "in_run_ratio_median": ratio, "ratios": [ratio] * 3, "modelled_ratio": ratio,
            "modelled_parts": {}, "step_ms_median": 50.0, "fixed_seconds_median": startup}


STEPTIME = {"config": {"optimizer": "adamw", "scale": "cpu-mini", "tokens_per_step": 2048},
            "methods": {"random": _timed(1.0, 1.0), "oracle": _timed(1.0, 1.0),
                        "rho@score_len=16": _timed(1.25, 31.0), "opus": _timed(1.5, 1.0)}}
SHORT = {"random": [3.60, 3.65, 3.70], "oracle": [3.50, 3.52, 3.61], "rho@score_len=16": [3.10, 3.21, 3.18],
         "rho@score_len=16@reference_steps=1200": [3.05, 3.15, 3.12], "opus": [3.55, 3.60, 3.66]}
LONG = {"random": [2.60, 2.62, 2.61], "oracle": [2.55, 2.56, 2.58], "rho@score_len=16": [2.45, 2.48, 2.46],
        "rho@score_len=16@reference_steps=1200": [2.40, 2.45, 2.41], "opus": [2.62, 2.59, 2.63]}
METHODS = list(SHORT)


def test_token_multiplier_is_the_crossing_over_randoms_tokens() -> None:
    results = _results({"random": [3.0], "m": [2.0]}, 1000)
    # m falls 4 → 2 linearly: it reaches random's 3.0 halfway
    assert horizons.token_multipliers(results, "m") == [pytest.approx(0.5)]
    assert horizons.token_multipliers(_results({"random": [3.0], "m": [3.5]}, 1000), "m") == [None]



def test_paired_gap_is_the_mean_over_shared_seeds_of_each_evaluations_difference() -> None:
    results = _results({"random": [3.0, 2.5], "m": [2.0, 2.6, 1.0]}, 1000)  # m's seed 2 has no random
    runs = results["methods"]
    brute = [np.mean([runs["m"]["runs"][s]["curve"][e][2] - runs["random"]["runs"][s]["curve"][e][2] for s in (0, 1)])
             for e in range(5)]
    assert horizons.paired_gap(results, "m") == pytest.approx(brute)
    assert horizons.paired_gap(results, "random") == [0.0] * 5
    unpaired = {"methods": {"random": {"runs": [_run(0, 3.0, 1000)]}, "m": {"runs": [_run(1, 2.0, 1000)]}}}
    assert horizons.paired_gap(unpaired, "m") is None


def test_reference_steps_variant_is_timed_as_its_base_with_a_scaled_startup() -> None:
    assert horizons.base_variant("rho@score_len=16@reference_steps=1200") == ("rho@score_len=16", 1200)
    assert horizons.base_variant("opus") is None
    timed = horizons.with_derived_timings(STEPTIME, METHODS)
    derived = timed["methods"]["rho@score_len=16@reference_steps=1200"]
    assert derived["in_run_ratio_median"] == 1.25
    assert derived["fixed_seconds_median"] == pytest.approx(1.0 + 1200 / 300 * 30.0)  # rho's default: 300 steps
    assert "rho@score_len=16@reference_steps=1200" not in STEPTIME["methods"]  # the file itself is left as it was


@pytest.mark.parametrize("short, long, expected", [
    ((-0.5, (-0.6, -0.4)), (-0.45, (-0.5, -0.4)), "holds"),
    ((-0.5, (-0.6, -0.4)), (-0.2, (-0.3, -0.1)), "shrinks"),
    ((-0.5, (-0.6, -0.4)), (-0.8, (-0.9, -0.7)), "grows"),
    ((-0.5, (-0.6, -0.4)), (-0.05, (-0.2, 0.1)), "vanishes"),
])
def test_verdict(short, long, expected) -> None:
    def cell(d):
        return {"diff_mean": d[0], "ci": d[1]}
    assert horizons.verdict(cell(short), cell(long)) == expected


def test_report_over_two_run_lengths(tmp_path) -> None:
    cells = []
    for name, finals, tokens in (("short", SHORT, 2_048_000), ("long", LONG, 32_768_000)):
        (tmp_path / f"{name}.json").write_text(json.dumps(_results(finals, tokens)))
        cells += ["--cell", f"cpu-mini={tmp_path / name}.json:{tmp_path / 'steptime.json'}"]
    (tmp_path / "steptime.json").write_text(json.dumps(STEPTIME))
    report = horizons.main([*cells, "--methods", ",".join(METHODS), "--curves", "cpu-mini-32M", "--out", str(tmp_path / "out")])
    assert [c["cell"] for c in report["cells"]] == ["cpu-mini-2M", "cpu-mini-32M"]
    by_method = {v["method"]: v for v in report["verdicts"]}
    assert by_method["rho@score_len=16"]["verdict"] == "shrinks" and by_method["opus"]["verdict"] == "vanishes"
    long_rho = report["rows"]["cpu-mini-32M"]["rho@score_len=16"]
    assert long_rho["diff_mean"] == pytest.approx(np.mean(np.subtract(LONG["rho@score_len=16"], LONG["random"])))
    assert long_rho["wall_charged"][0] > long_rho["wall"][0] > long_rho["step"] * long_rho["tokens"][0] - 1e-9
    text = (tmp_path / "out" / "report.md").read_text()
    assert "**shrinks**" in text and "(derived)" in text and "curves-cpu-mini-32M.png" in text
    for png in ("delta_vs_horizon.png", "tokens_vs_horizon.png", "curves-cpu-mini-32M.png"):
        assert (tmp_path / "out" / png).stat().st_size > 0
    with pytest.raises(SystemExit, match="no such cell"):
        horizons.main([*cells, "--methods", "random,opus", "--curves", "cpu-mini-9M", "--out", str(tmp_path / "x")])
