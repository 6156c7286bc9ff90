"""bench.harness.race: the step budget, the schedule it sets, the table, and one race on the toy corpus."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time

import pytest
import yaml

from bench.harness import race
from bench.harness.train_child import ROOT
from selection_callbacks.nn.optim import warmup_cosine


def test_step_budget_spends_the_budget_less_the_overhead_in_whole_even_steps() -> None:
    assert race.step_budget(120, 30, 0.2) == 450  # (120 − 30) / 0.2
    assert race.step_budget(120, 30.1, 0.2) == 448  # 449.5 → 449 → even
    assert race.step_budget(10, 9.5, 0.2) == 2
    with pytest.raises(SystemExit, match="leaves no steps after 9.7 s of overhead"):
        race.step_budget(10, 9.7, 0.2)


@pytest.mark.parametrize("budget, overhead, step", [(120, 30, 0.2), (180, 25, 0.05), (20, 12, 0.01), (12, 11.5, 0.2)])
def test_the_schedule_decays_fully_within_the_budgeted_steps(budget, overhead, step) -> None:
    steps = race.step_budget(budget, overhead, step)
    warmup = race.capped_warmup(steps, 200)
    assert overhead + steps * step <= budget and warmup <= race.WARMUP_SHARE * steps
    lr = warmup_cosine(warmup, steps, 0.1)
    assert lr(steps) == pytest.approx(0.1)  # the cosine's floor (min_lr_ratio) at max_steps: the decay is complete
    assert max(lr(s) for s in range(steps)) == pytest.approx(1.0)  # the warmup reaches the peak before the decay
    assert all(lr(s) >= lr(s + 1) for s in range(warmup, steps))


def test_capped_warmup_keeps_the_configured_one_on_a_long_run() -> None:
    assert race.capped_warmup(2000, 200) == 200 and race.capped_warmup(450, 200) == 90
    assert race.capped_warmup(4, 200) == 0


def _entry(step: float, steps: int, wall: float, bpb: float, within: bool = True) -> dict:
    probe = {"step_seconds": step, "one_off_seconds": 2.0, "startup_validation_seconds": 8.0}
    return {"warmup_steps": 5, "probe": probe,
            "race": {"step_seconds": step, "max_steps": steps, "update_tokens": steps * 2048, "wall_seconds": wall,
                     "overrun_seconds": wall - 100, "within_slack": within, "val_bpb": bpb}}


def test_table_rows_deltas_and_overrun() -> None:
    result = {"config": {"scale": "cpu-tiny", "optimizer": "adamw", "ratio": 0.5, "budget": 100.0, "seed": 0,
                         "threads": 1, "tuned": None, "probe_steps": 20, "slack": 0.1},
              "methods": {"random": _entry(0.2, 450, 101.5, 3.9), "rho": _entry(0.3, 260, 115.0, 3.8, within=False)},
              "machine": "Machine: AMD EPYC; other processes held at most 1.20 CPUs during a run."}
    table = race.markdown(result, ["--budget", "100"])
    assert "`python -m bench.harness.race --budget 100`" in table
    assert "| random | 200.0 | 200.0 | 2.0 | 8.0 | 450 | 5 | 921,600 | 101.5 / 100 | +1.5 | 3.9000 | +0.0000 |" in table
    assert ("| rho | 300.0 | 300.0 | 2.0 | 8.0 | 260 | 5 | 532,480 | 115.0 / 100 | +15.0 **over the slack** | 3.8000 | "
            "-0.1000 |") in table
    assert table.splitlines()[-1].startswith("Machine: ")


def test_race_on_the_toy_corpus(tiny_corpus, tmp_path) -> None:
    scale = yaml.safe_load((ROOT / "configs" / "scale" / "cpu-tiny.yaml").read_text())
    scale["model"]["config"].update(n_layer=1, n_head=2, n_embd=32)
    scale["data"].update(seq_len=32, batch_size=4, val_samples=16)
    scale["trainer"]["logger"] = False
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(scale))
    start = time.perf_counter()  # one process start-up at the machine's present load: the budget leaves room for it
    subprocess.run([sys.executable, "-c", "import train"], cwd=ROOT, check=True)
    budget = max(24.0, 3 * (time.perf_counter() - start))
    # whether a run keeps to its budget depends on the machine's load between its probe and its race, which a test
    # does not control (the slack is one no load reaches); that each run's length follows from its own probe does not
    result = race.main(["--pool", tiny_corpus["pool"], "--target", tiny_corpus["target"], "--val", tiny_corpus["val"],
                        "--methods", "random,rho@reference_steps=60", "--budget", str(budget), "--slack", "1000",
                        "--probe-steps", "10", "--scale", str(tmp_path / "tiny.yaml"), "--out", str(tmp_path / "race")])
    saved = json.loads((tmp_path / "race" / "race.json").read_text())
    assert saved["methods"].keys() == {"random", "rho@reference_steps=60"} and saved["config"]["tuned"] is None
    for entry in saved["methods"].values():
        p, r = entry["probe"], entry["race"]
        assert r["max_steps"] == race.step_budget(budget, p["overhead_seconds"], p["step_seconds"])
        assert r["global_step"] == r["max_steps"] >= 2 and r["update_tokens"] > 0 and math.isfinite(r["val_bpb"])
        assert entry["warmup_steps"] == min(50, math.floor(0.2 * r["max_steps"]))  # cpu-tiny's 50, capped
    # the reference RHO-LOSS pretrains when training starts is a one-off, charged to its budget
    rho, rnd = saved["methods"]["rho@reference_steps=60"], saved["methods"]["random"]
    assert rho["probe"]["one_off_seconds"] > rnd["probe"]["one_off_seconds"]
    assert "| rho@reference_steps=60 |" in (tmp_path / "race" / "race.md").read_text() and result == saved
