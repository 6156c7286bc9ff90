"""bench.harness.demo end to end on a tiny corpus: both runs train, the table, demo.json and demo.png agree."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from bench.harness import demo

TINY = ["--model.config.n_layer", "1", "--model.config.n_embd", "32", "--model.config.n_head", "2",
        "--data.seq_len", "32", "--data.val_samples", "16"]
SMALL_REFERENCE = ["--selection.init_args.reference_steps", "5", "--selection.init_args.proxy_layers", "1",
                   "--selection.init_args.proxy_width", "32"]


def first_wall_at(curve: list[list[float]], target: float) -> float | None:
    """The first train second at which val bpb ≤ target, linear between validations (None: never)."""
    for i, (_, wall, bpb) in enumerate(curve):
        if bpb <= target:
            if i == 0:
                return wall
            (_, wall0, bpb0) = curve[i - 1]
            return float(np.interp(target, [bpb, bpb0], [wall, wall0]))
    return None


def test_demo_trains_both_runs_and_reports_consistent_numbers(tiny_corpus, tmp_path: Path, capsys, monkeypatch) -> None:
    data = tmp_path / "data"
    data.mkdir()
    for split, path in tiny_corpus.items():
        (data / f"{split}.jsonl").symlink_to(path)
    monkeypatch.setitem(demo.RUNS, "rho@score_len=16", [*demo.RUNS["rho@score_len=16"], *SMALL_REFERENCE])
    out = tmp_path / "demo"
    result = demo.main(["--data", str(data), "--out", str(out), "--steps", "6", "--evals", "3",
                        "--progress_every", "1", "--", *TINY])
    printed = capsys.readouterr().out

    saved = json.loads((out / "demo.json").read_text())
    assert saved == json.loads(json.dumps(result))
    assert (out / "demo.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    random, rho = saved["runs"]["random"], saved["runs"]["rho@score_len=16"]
    assert saved["update_tokens"] == 6 * 16 * 32
    for run in (random, rho):
        assert [p[0] for p in run["curve"]] == [2 * 16 * 32, 4 * 16 * 32, 6 * 16 * 32]  # paired budgets, 3 validations
        assert run["final_val_bpb"] == run["curve"][-1][2] and run["train_seconds"] == run["curve"][-1][1]
        assert run["cpu_seconds"] > 0
        assert run["machine"]["torch_threads"] == 1
    assert random["delta"] == 0.0 and random["wall_to_baseline_final"] == 1.0
    assert rho["delta"] == pytest.approx(rho["final_val_bpb"] - random["final_val_bpb"], abs=1e-12)
    seconds = first_wall_at(rho["curve"], random["final_val_bpb"])
    if seconds is None:
        assert rho["seconds_to_baseline_final"] is None and "not reached" in printed
    else:
        assert rho["seconds_to_baseline_final"] == pytest.approx(seconds)
        assert rho["wall_to_baseline_final"] == pytest.approx(seconds / random["curve"][-1][1])
        assert f"{seconds:.0f} s ({rho['wall_to_baseline_final']:.2f}×)" in printed

    rows = {line.split("|")[1].strip(): line for line in printed.splitlines() if line.startswith("| ")}
    assert f"| {rho['final_val_bpb']:.4f} | {rho['delta']:+.4f} |" in rows["rho@score_len=16"]
    assert f"| {random['final_val_bpb']:.4f} | +0.0000 |" in rows["random"]
    assert printed.count("[demo]") >= 4  # the banner, progress lines of both runs, the closing lines
