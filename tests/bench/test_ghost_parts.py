"""bench.studies.ghost_parts: exclusive part times, and OPUS's selection split into parts in a real train.py run."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

from bench.harness.train_child import ROOT
from bench.studies import ghost_parts

SCALE = {
    "seed_everything": 0,
    "trainer": {"accelerator": "cpu", "devices": 1, "check_val_every_n_epoch": None, "num_sanity_val_steps": 0,
                "enable_checkpointing": False, "enable_model_summary": False, "logger": False,
                "enable_progress_bar": False},
    "model": {"config": {"n_layer": 1, "n_head": 2, "n_embd": 32, "vocab_size": 320}, "warmup_steps": 1},
    "data": {"seq_len": 32, "batch_size": 4, "val_samples": 8, "ratio": 0.5},
}


def test_part_clock_takes_nested_parts_out_of_their_parent(monkeypatch) -> None:
    """rest 0→10 holding sampling 2→5 and windows 6→7: rest keeps 10 − 3 − 1 = 6 seconds."""
    ticks = iter([0.0, 2.0, 5.0, 6.0, 7.0, 10.0])
    monkeypatch.setattr(ghost_parts.time, "perf_counter", lambda: next(ticks))
    clock = ghost_parts.PartClock()
    with clock.part("rest"):
        assert clock.active
        with clock.part("sampling"):
            pass
        with clock.part("windows"):
            pass
    assert clock.current == {"rest": 6.0, "sampling": 3.0, "windows": 1.0} and not clock.active
    selections = [(0, {"rest": 9.0}), (2, {"rest": 1.0, "forward": 2.0}), (3, {"rest": 3.0})]
    means = ghost_parts.per_step(selections, 1, 4)  # step 0's selection is outside the slope
    assert means["rest"] == 2.0 and means["forward"] == 1.0 and means["sampling"] == 0.0
    with pytest.raises(ValueError, match="no selection between"):
        ghost_parts.per_step(selections, 5, 8)


def test_opus_parts_cover_its_selection(tiny_corpus, tmp_path) -> None:
    """OPUS on the toy corpus, re-run with timers: every part of its selection takes time, the timed parts stay within
    the selection seconds the run recorded (the rest is their difference), and the study sets the parts beside the
    calibrated passes of the folder's pass_timing.json."""
    scale = tmp_path / "scale.yaml"
    scale.write_text(yaml.safe_dump(SCALE))
    run = tmp_path / "steptime" / "runs" / "abc" / "opus" / "seed0"
    cmd = [sys.executable, str(ROOT / "train.py"), "fit", "--config", str(scale), "--config",
           str(ROOT / "configs/method/opus.yaml"), "--data.pool", tiny_corpus["pool"], "--data.target",
           tiny_corpus["target"], "--data.val", tiny_corpus["val"], "--trainer.max_steps", "4",
           "--trainer.val_check_interval", "2", "--trainer.default_root_dir", str(run),
           "--selection.init_args.score_len", "8", "--selection.init_args.sketch_dim", "64"]
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True)
    passes = {"learner_fwd": 0.001, "learner_reached_bwd": 0.002}
    (tmp_path / "steptime" / "pass_timing.json").write_text(json.dumps(
        {"plain_step_seconds": 0.01, "methods": {"opus": {"seconds_per_step": passes}}}))
    (tmp_path / "steptime" / "steptime.json").write_text(json.dumps(
        {"config": {"steps": 16, "eval_every": 4, "threads": 1},
         "methods": {"random": {"runs": [{"selection_step_seconds": s} for s in (1e-4, 3e-4, 2e-4)]}}}))
    result = ghost_parts.main([str(tmp_path / "steptime")])["methods"]["opus"]  # 16 steps, validating every 4
    parts = result["parts"]
    assert set(parts) == set(ghost_parts.PARTS)
    assert all(parts[p] > 0 for p in ghost_parts.PARTS), parts
    covered = sum(parts.values())
    assert covered == pytest.approx(result["selection_step_seconds"]) and covered < result["step_seconds"]
    base = result["step_seconds"] - result["selection_step_seconds"] + 2e-4  # random's median selection
    assert result["base_seconds"] == pytest.approx(base)
    assert result["in_run_ratio"] == pytest.approx(result["step_seconds"] / base)
    counted = parts["forward"] + parts["backward"] + parts["utilities"]
    assert result["counted_share"] == pytest.approx(counted / base)
    assert result["left_out_share"] == pytest.approx((covered - counted) / base)
    assert result["calibrated_share"] == pytest.approx(0.003 / base)
    assert result["calibrated_passes"] == passes
    assert json.loads((tmp_path / "steptime" / "ghost_parts.json").read_text())["methods"]["opus"] == result
    with pytest.raises(SystemExit, match="no runs/<config>/greats"):
        ghost_parts.main([str(tmp_path / "steptime"), "--method", "greats"])
