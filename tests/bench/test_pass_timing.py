"""bench.harness.pass_timing: pass shapes read from a run's config and counts, the calibrated ratio's arithmetic,
and timings of real passes."""

from __future__ import annotations

import json

import pytest
import torch
import yaml

from bench.harness import pass_timing
from selection_callbacks.nn.gpt import GPTConfig

LEARNER = {"vocab_size": 320, "block_size": 32, "n_layer": 1, "n_head": 2, "n_embd": 32, "dropout": 0.0, "bias": False}


def _config(init: dict) -> dict:
    return {"model": {"init_args": {"config": LEARNER}}, "data": {"seq_len": 32, "batch_size": 4},
            "selection": {"init_args": init}}


def _metrics(cost: dict) -> dict:
    return {"global_step": 10, "selection": {"cost": cost}}


def test_run_passes_reads_windows_rows_and_models() -> None:
    """RHO-LOSS on 8-token windows over N = 8 rows: both forwards are 8 rows × 8 tokens; the pretraining is left out;
    the proxy follows proxy_layers × proxy_width with the learner's vocabulary and context."""
    config = _config({"score_len": 8, "proxy_layers": 2, "proxy_width": 64, "proxy_heads": 4})
    cost = {"learner_fwd": {"passes": 10, "tokens": 640}, "reference_fwd": {"passes": 10, "tokens": 640},
            "reference_pretrain_fwd": {"passes": 5, "tokens": 640}}
    passes = pass_timing.run_passes(config, _metrics(cost))
    assert passes == {"learner_fwd": {"model": "learner", "kind": "fwd", "per_step": 1.0, "rows": 8, "length": 8,
                                      "scale": 1.0},
                      "reference_fwd": {"model": "proxy", "kind": "fwd", "per_step": 1.0, "rows": 8, "length": 8,
                                        "scale": 1.0}}
    models = pass_timing.run_models(config)
    assert models["proxy"] == GPTConfig(**{**LEARNER, "n_layer": 2, "n_embd": 64, "n_head": 4})
    assert models["learner"] == GPTConfig(**LEARNER)
    uneven = pass_timing.run_passes(config, _metrics({"learner_fwd": {"passes": 10, "tokens": 500}}))["learner_fwd"]
    assert (uneven["rows"], uneven["scale"]) == (6, pytest.approx(6.25 / 6))  # 50 tokens a pass: 6.25 rows of 8


def test_calibrated_ratio_is_the_passes_seconds_over_the_plain_step() -> None:
    """A backward costs its training pass minus its forward; a proxy's training pass steps its optimizer, the
    learner's scoring backward does not."""
    passes = {"online_fwd": {"model": "proxy", "kind": "fwd", "per_step": 2.0, "rows": 8, "length": 32, "scale": 1.5},
              "online_bwd": {"model": "proxy", "kind": "bwd", "per_step": 1.0, "rows": 8, "length": 32},
              "learner_reached_bwd": {"model": "learner", "kind": "bwd", "per_step": 1.0, "rows": 8, "length": 32}}
    shapes = pass_timing.pass_shapes(passes)
    assert shapes["online_bwd"] == [("proxy", 8, 32, "train"), ("proxy", 8, 32, "fwd")]
    assert shapes["learner_reached_bwd"] == [("learner", 8, 32, "grad"), ("learner", 8, 32, "fwd")]
    seconds = {("proxy", 8, 32, "fwd"): 0.1, ("proxy", 8, 32, "train"): 0.4, ("learner", 8, 32, "fwd"): 0.05,
               ("learner", 8, 32, "grad"): 0.2}
    out = pass_timing.calibrated(passes, seconds, step=0.5)
    assert out["seconds"] == pytest.approx({"online_fwd": 0.3, "online_bwd": 0.3, "learner_reached_bwd": 0.15})
    assert out["ratio"] == pytest.approx(1 + 0.75 / 0.5)


def test_a_forward_is_timed_with_the_row_losses_scoring_reads(monkeypatch) -> None:
    """A timed forward computes each row's mean token loss over the vocabulary, as a scoring forward does; the loss
    equals the brute-force mean of −log softmax at the next tokens."""
    timer = pass_timing.Timer({"proxy": GPTConfig(**LEARNER)}, budget=0.01)
    seen = []
    real = pass_timing.row_losses
    monkeypatch.setattr(pass_timing, "row_losses", lambda logits, targets: seen.append(real(logits, targets)) or seen[-1])
    timer.call(("proxy", 3, 16, "fwd"))
    assert len(seen) == 1 and seen[0].shape == (3,)
    logits, targets = torch.randn(2, 5, 7), torch.randint(0, 7, (2, 5))
    by_hand = torch.stack([torch.stack([-torch.log_softmax(logits[r, t], 0)[targets[r, t]] for t in range(5)]).mean()
                           for r in range(2)])
    torch.testing.assert_close(real(logits, targets), by_hand)


def test_time_runs_times_real_passes(tmp_path) -> None:
    """Two runs' folders timed for real: a training pass outlasts a forward of the same shape, a run without passes
    reads 1, and runs of different learners are refused."""
    config = _config({"score_len": 8, "proxy_layers": 1, "proxy_width": 64, "proxy_heads": 2})
    runs = {}
    for name, cost in (("random", {}), ("rho", {"reference_fwd": {"passes": 10, "tokens": 640}})):
        folder = tmp_path / name / "seed0"
        folder.mkdir(parents=True)
        (folder / "config.yaml").write_text(yaml.safe_dump(config))
        (folder / "metrics.json").write_text(json.dumps(_metrics(cost)))
        runs[name] = [folder]
    timer = pass_timing.Timer(pass_timing.run_models(config), budget=0.02)
    seconds = timer.seconds([("proxy", 8, 32, "fwd"), ("proxy", 8, 32, "train")])
    assert seconds[("proxy", 8, 32, "train")] > seconds[("proxy", 8, 32, "fwd")] > 0
    out = pass_timing.time_runs(runs, rounds=2, budget=0.02, run_steps=0)  # train.py's re-run: tests/bench/test_bench.py
    assert out["methods"]["random"]["ratios"] == [1.0, 1.0] and out["methods"]["rho"]["ratio"] > 1.0
    assert len(out["methods"]["rho"]["ratios"]) == 2 and out["rounds"] == 2  # one ratio per round's process
    assert len(out["other_cpus"]) == 2 and all(x is None or x >= 0 for x in out["other_cpus"])
    assert out["plain_step"] == "learner" and out["framework_share"] == 0.0
    with pytest.raises(ValueError, match="multiple of 4"):
        pass_timing.run_step(tmp_path, 10)
    other = tmp_path / "wide" / "seed0"
    other.mkdir(parents=True)
    (other / "config.yaml").write_text(yaml.safe_dump({**config, "data": {"seq_len": 32, "batch_size": 8}}))
    (other / "metrics.json").write_text(json.dumps(_metrics({})))
    with pytest.raises(ValueError, match="differ in learner, batch or sequence length"):
        pass_timing.time_runs({**runs, "wide": [other]}, rounds=1, budget=0.01, run_steps=0)
