"""bench.harness.compare on a tiny run: schema, report, plots, resume, paired reproducibility, offline prepare."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from bench.harness import compare as bench_compare
from bench.harness.methods import REGISTRY, Method, resolve
from bench.harness.report import crossing, paired_test
from selection_callbacks.data.readers import iter_documents
from selection_callbacks.data.subset import write_subset

TINY_SCALE = """
seed_everything: 0
trainer:
  accelerator: cpu
  devices: 1
  max_steps: 10
  check_val_every_n_epoch: null
  num_sanity_val_steps: 0
  enable_checkpointing: false
  enable_model_summary: false
  logger: false
model:
  config: {n_layer: 1, n_head: 2, n_embd: 32, vocab_size: 320}
  warmup_steps: 1
data:
  seq_len: 32
  batch_size: 4
  val_samples: 16
"""


def first_docs_selector(pool: str, target: str, budget: int, seed: int, out: Path) -> Path:
    """A test-only offline selector: the first prose documents."""
    docs = [d.id for d in iter_documents(pool) if d.domain == "prose"][:60]
    return write_subset(out / "subset.parquet", "doc_id", docs)


def _args(corpus, out: Path, scale: Path, methods: str, seeds: str = "2") -> list[str]:
    return ["--pool", corpus["pool"], "--target", corpus["target"], "--val", corpus["val"], "--methods", methods,
            "--tokens", str(6 * 4 * 32), "--seeds", seeds, "--ratio", "0.5", "--scale", str(scale), "--evals", "3",
            "--out", str(out), "--allow-untuned"]


@pytest.fixture(scope="module")
def bench_run(tiny_corpus, tmp_path_factory):
    root = tmp_path_factory.mktemp("bench")
    scale = root / "tiny.yaml"
    scale.write_text(TINY_SCALE)
    REGISTRY["first_docs"] = Method("first_docs", select=first_docs_selector)
    try:
        results = bench_compare.main(_args(tiny_corpus, root / "out", scale, "random,high_loss,oracle,first_docs"))
    finally:
        del REGISTRY["first_docs"]
    return root, scale, results


def test_results_schema(bench_run) -> None:
    root, _, results = bench_run
    on_disk = json.loads((root / "out" / "results.json").read_text())
    assert on_disk["commit"] and on_disk["config_hash"] == results["config_hash"]
    assert set(on_disk["methods"]) == {"random", "high_loss", "oracle", "first_docs"}
    for entry in on_disk["methods"].values():
        assert [r["seed"] for r in entry["runs"]] == [0, 1]
        for r in entry["runs"]:
            assert {"seed", "final_val_bpb", "curve", "step_time_ratio", "overhead_fraction", "selection_seconds",
                    "domains"} <= set(r)
            assert [p[0] for p in r["curve"]] == [2 * 128, 4 * 128, 6 * 128]  # fixed update-token grid
            assert r["curve"][-1][2] == r["final_val_bpb"]
            assert sum(r["domains"].values()) == pytest.approx(1.0)
    assert all(r["step_time_ratio"] == 1.0 for r in on_disk["methods"]["random"]["runs"])
    assert on_disk["methods"]["first_docs"]["offline"] and on_disk["methods"]["first_docs"]["runs"][0]["domains"] == {"prose": 1.0}
    assert all(r["domains"]["prose"] >= 0.5 for r in on_disk["methods"]["oracle"]["runs"])


def test_report_and_plots(bench_run) -> None:
    root, _, _ = bench_run
    report = (root / "out" / "report.md").read_text()
    for name in ("random", "high_loss", "oracle", "first_docs"):
        assert f"| {name} | 2 |" in report
    assert "Δ vs random" in report and "share of its oracle" in report
    assert report.index("| method | seeds |") < report.index("Final val bits-per-byte")  # the table first
    for png in ("curves_loss.png", "curves_offline.png", "domains_over_time.png"):  # a plot per family
        assert f"({png})" in report and (root / "out" / png).stat().st_size > 5000
    assert not (root / "out" / "curves_reference.png").exists()  # random and the oracle are on every plot
    assert "| random | seed 0: alone" in report or "| random | seed 0: beside ~" in report


def test_results_json_alone_carries_each_runs_metrics(bench_run) -> None:
    """A committed comparison keeps results.json, not the run folders: each record holds what its metrics.json did."""
    root, _, _ = bench_run
    on_disk = json.loads((root / "out" / "results.json").read_text())
    for entry in on_disk["methods"].values():
        for r in entry["runs"]:
            m = json.loads((root / "out" / r["run_dir"] / "metrics.json").read_text())
            assert (r["val_loss"], r["global_step"], r["update_tokens"], r["train_wall_seconds"]) == (
                m["val_loss"], m["global_step"], m["update_tokens"], m["wall_seconds"])
            assert r["final_val_bpb"] == m["val_bpb"] and r["update_tokens"] == r["curve"][-1][0]


def test_report_redraws_the_plots_from_results_json_alone(bench_run, tmp_path) -> None:
    from bench.harness import report as bench_report

    root, _, _ = bench_run
    results = tmp_path / "committed" / "results.json"  # the folder holds results.json and nothing else
    results.parent.mkdir()
    results.write_bytes((root / "out" / "results.json").read_bytes())
    written = bench_report.main(["--results", str(results), "--out", str(tmp_path / "plots"), "--markdown"])
    names = {p.name for p in written}
    assert {"curves_loss.png", "curves_offline.png", "domains_over_time.png", "report.md"} <= names
    assert all(p.stat().st_size > 5000 for p in written if p.suffix == ".png")
    assert (tmp_path / "plots" / "report.md").read_text() == (root / "out" / "report.md").read_text()


def test_rerun_skips_finished_runs(bench_run, tiny_corpus, capsys) -> None:
    root, scale, results = bench_run
    again = bench_compare.main(_args(tiny_corpus, root / "out", scale, "random,high_loss"))
    out = capsys.readouterr().out
    assert out.count("finished, skipped") == 4 and "training" not in out
    assert again["methods"]["random"]["runs"][0]["curve"] == results["methods"]["random"]["runs"][0]["curve"]


def test_a_fresh_clone_resumes_from_the_committed_results_json(bench_run, tiny_corpus, tmp_path, capsys) -> None:
    """results.json alone (no run folders, as a clone holds it) carries finished runs; a partial one resumes."""
    root, scale, results = bench_run
    clone = tmp_path / "clone"
    clone.mkdir()
    (clone / "results.json").write_text((root / "out" / "results.json").read_text())
    again = bench_compare.main(_args(tiny_corpus, clone, scale, "random,high_loss"))
    out = capsys.readouterr().out
    assert out.count("(recorded in results.json), skipped") == 4 and "training" not in out
    assert again["methods"]["high_loss"]["runs"][1]["curve"] == results["methods"]["high_loss"]["runs"][1]["curve"]
    partial = json.loads((root / "out" / "results.json").read_text())
    partial["methods"] = {"random": {**partial["methods"]["random"], "runs": partial["methods"]["random"]["runs"][1:]}}
    (clone / "results.json").write_text(json.dumps(partial))
    resumed = bench_compare.main(_args(tiny_corpus, clone, scale, "random"))
    out = capsys.readouterr().out
    assert "random seed 0: training" in out and "random seed 1: finished (recorded in results.json)" in out
    assert [r["final_val_bpb"] for r in resumed["methods"]["random"]["runs"]] == pytest.approx(
        [r["final_val_bpb"] for r in results["methods"]["random"]["runs"]], abs=1e-6)



def test_a_rerun_with_fewer_methods_and_seeds_keeps_every_earlier_record(bench_run, tiny_corpus, tmp_path) -> None:
    root, scale, results = bench_run
    (tmp_path / "results.json").write_text((root / "out" / "results.json").read_text())
    bench_compare.main(_args(tiny_corpus, tmp_path, scale, "random", seeds="1"))  # random seed 0 alone, recorded
    on_disk = json.loads((tmp_path / "results.json").read_text())
    assert list(on_disk["methods"]) == ["random", "high_loss", "oracle", "first_docs"]
    for name, entry in results["methods"].items():
        assert [(r["seed"], r["final_val_bpb"]) for r in on_disk["methods"][name]["runs"]] == [
            (r["seed"], r["final_val_bpb"]) for r in entry["runs"]]


def test_a_results_json_of_another_config_is_refused_not_overwritten(bench_run, tiny_corpus, tmp_path) -> None:
    root, scale, _ = bench_run
    other = json.loads((root / "out" / "results.json").read_text()) | {"config_hash": "0" * 12}
    (tmp_path / "results.json").write_text(json.dumps(other))
    with pytest.raises(SystemExit, match="records 8 runs of comparison config 000000000000.*move that results.json aside"):
        bench_compare.main(_args(tiny_corpus, tmp_path, scale, "random"))
    assert json.loads((tmp_path / "results.json").read_text()) == other


def test_runs_trained_at_once_match_runs_trained_one_by_one(bench_run, tiny_corpus, tmp_path) -> None:
    root, scale, results = bench_run
    both = bench_compare.main([*_args(tiny_corpus, tmp_path, scale, "random,high_loss"), "--jobs", "2"])
    assert [r["seed"] for r in both["methods"]["high_loss"]["runs"]] == [0, 1]
    for name in ("random", "high_loss"):
        assert [r["final_val_bpb"] for r in both["methods"][name]["runs"]] == pytest.approx(
            [r["final_val_bpb"] for r in results["methods"][name]["runs"]], abs=1e-6)


def test_a_recorded_run_of_an_edited_method_config_is_refused(bench_run, tiny_corpus, tmp_path) -> None:
    root, scale, _ = bench_run
    recorded = json.loads((root / "out" / "results.json").read_text())
    recorded["methods"]["high_loss"]["runs"][0]["identity"] = "0" * 16
    (tmp_path / "results.json").write_text(json.dumps(recorded))
    with pytest.raises(SystemExit, match="another method config"):
        bench_compare.main(_args(tiny_corpus, tmp_path, scale, "random,high_loss"))


def test_rerun_refuses_runs_of_an_edited_method_config(bench_run, tiny_corpus) -> None:
    root, scale, results = bench_run
    recorded = next((root / "out" / "runs").glob("*/high_loss/seed0/method.txt"))
    original = recorded.read_text()
    assert "HighLossSelection" in original
    recorded.write_text(original.replace("HighLossSelection", "HighLossSelectionV0"))
    try:
        with pytest.raises(SystemExit, match="another method config"):
            bench_compare.main(_args(tiny_corpus, root / "out", scale, "random,high_loss"))
    finally:
        recorded.write_text(original)


def test_same_seed_same_bpb_at_same_tokens(bench_run, tiny_corpus) -> None:
    root, scale, results = bench_run
    fresh = bench_compare.main(_args(tiny_corpus, root / "fresh", scale, "random", seeds="1"))
    a = np.asarray(results["methods"]["random"]["runs"][0]["curve"])
    b = np.asarray(fresh["methods"]["random"]["runs"][0]["curve"])
    assert np.array_equal(a[:, 0], b[:, 0]) and np.allclose(a[:, 2], b[:, 2], rtol=0, atol=1e-6)
    assert results["methods"]["random"]["runs"][0]["final_val_bpb"] != results["methods"]["random"]["runs"][1]["final_val_bpb"]


def test_unknown_methods() -> None:
    with pytest.raises(SystemExit, match="'nope' is unknown"):
        resolve(["random", "nope"])
    with pytest.raises(SystemExit, match="include 'random'"):
        resolve(["high_loss"])


def test_crossing_interpolates_and_paired_test() -> None:
    curve = [[100, 1.0, 3.0], [200, 2.0, 2.0], [300, 3.0, 1.0]]
    assert crossing(curve, 2.5, 0) == 150 and crossing(curve, 1.5, 1) == 2.5
    assert crossing(curve, 0.5, 0) is None and crossing(curve, 3.5, 0) == 100
    mean, std, p = paired_test([-0.1, -0.12, -0.09])
    assert mean == pytest.approx(-0.10333, abs=1e-4) and std > 0 and p < 0.01


BENCHMARKS_PAGE = Path(__file__).resolve().parents[2] / "docs" / "benchmarks.md"


@pytest.mark.parametrize("block", ["default-adamw", "packages-adamw", "default-muon", "cpu-tiny-muon"])
def test_readme_headline_is_generated_from_the_committed_results(block: str) -> None:
    from bench.harness.headline import ROOT_README, headline, rewrite

    results = ROOT_README.parent / "bench" / "results" / block / "results.json"
    assert results.exists(), f"{results} is the committed comparison the README quotes"
    assert rewrite(BENCHMARKS_PAGE, block, headline(results)) == BENCHMARKS_PAGE.read_text()


def test_method_variants_pass_selection_overrides(tiny_corpus, tmp_path) -> None:
    methods, overrides = bench_compare.resolve_variants(["random", "high_loss@temperature=0.3@sampling=gumbel"])
    assert [m.name for m in methods] == ["random", "high_loss@temperature=0.3@sampling=gumbel"]
    assert methods[1].config == REGISTRY["high_loss"].config
    args = bench_compare.build_parser().parse_args(_args(tiny_corpus, tmp_path, Path("cpu-tiny"), "random"))
    plan = bench_compare.Plan(args)
    plan.overrides = overrides
    cmd = plan.train_command(methods[1], 0, None)
    assert cmd[cmd.index("--selection.init_args.temperature") + 1] == "0.3"
    assert cmd[cmd.index("--selection.init_args.sampling") + 1] == "gumbel"
    assert "--selection.init_args.temperature" not in plan.train_command(methods[0], 0, None)
    with pytest.raises(SystemExit, match="expected name@arg=value"):
        bench_compare.resolve_variants(["random", "opus@temperature"])


def test_committed_keys_with_an_old_argument_name_run_with_the_new_one(tiny_corpus, tmp_path) -> None:
    """``opus@proxy_batch_size=32`` and ``opus@stack_layers=true`` (keys of bench/results) set target_batch_size and
    group_layers; the method keeps its recorded name."""
    names = ["random", "opus@proxy_batch_size=32@stack_layers=true"]
    methods, overrides = bench_compare.resolve_variants(names)
    args = bench_compare.build_parser().parse_args(_args(tiny_corpus, tmp_path, Path("cpu-tiny"), "random"))
    plan = bench_compare.Plan(args)
    plan.overrides = overrides
    cmd = plan.train_command(methods[1], 0, None)
    assert methods[1].name == names[1]
    assert cmd[cmd.index("--selection.init_args.target_batch_size") + 1] == "32"
    assert cmd[cmd.index("--selection.init_args.group_layers") + 1] == "true"
    assert not any(a.startswith("--") and ("proxy_batch_size" in a or "stack_layers" in a) for a in cmd)


def test_steptime_ratios_from_interleaved_runs(bench_run, tiny_corpus) -> None:
    from bench.harness import pass_timing, steptime

    root, scale, _ = bench_run
    out = root / "steptime"
    result = steptime.main(["--pool", tiny_corpus["pool"], "--target", tiny_corpus["target"], "--val",
                            tiny_corpus["val"], "--methods", "random,high_loss,rho_lookup@reference_steps=2", "--steps", "6", "--evals", "3",
                            "--repeats", "2", "--scale", str(scale), "--out", str(out)])
    m = result["methods"]
    assert m["random"]["ratios"] == [1.0, 1.0] and len(m["high_loss"]["ratios"]) == 2
    for name in ("random", "high_loss"):
        for run in m[name]["runs"]:
            assert run["step_seconds"] > 0
    assert m["high_loss"]["selection_fraction_median"] > m["random"]["selection_fraction_median"]
    # high-loss's one extra pass: a learner forward over the N = K/ρ candidates, 1/(3ρ) of a training step
    assert m["random"]["modelled_ratio"] == 1.0 and m["high_loss"]["modelled_ratio"] == pytest.approx(1 + 2 / 3)
    # looked-up reference losses: the learner's forward is the only pass left, as for high-loss
    assert m["rho_lookup@reference_steps=2"]["modelled_ratio"] == pytest.approx(1 + 2 / 3)
    table = (out / "steptime.md").read_text()
    assert "| high_loss |" in table
    machine = table.splitlines()[-1]  # every run's processor and how busy the machine was
    assert machine.startswith("Machine: ") and "other processes held at most" in machine
    assert all("cpu" in run and "other_cpus" in run for run in m["high_loss"]["runs"])
    # in-run: each run's own selection seconds over the slope's points; random's is 1 by construction
    assert m["random"]["in_run_ratios"] == [1.0, 1.0]
    assert all(r > 1 for r in m["high_loss"]["in_run_ratios"]) and m["high_loss"]["in_run_ratio_median"] > 1
    with pytest.raises(SystemExit, match="offline selector"):
        steptime.main(["--pool", tiny_corpus["pool"], "--target", tiny_corpus["target"], "--val", tiny_corpus["val"],
                       "--methods", "random,dsir", "--out", str(out)])
    # the cost model's calibration: the runs' passes timed on this host against random's run re-run by train.py
    timing = pass_timing.main([str(out), "--rounds", "1", "--run-steps", "8"])
    assert json.loads((out / "pass_timing.json").read_text()) == timing and timing["plain_step"] == "train.py"
    assert timing["plain_step_seconds"] > 0 and timing["learner_step_seconds"] > 0
    assert timing["methods"]["random"]["ratio"] == 1.0 and timing["methods"]["high_loss"]["ratio"] > 1.0
    assert set(timing["methods"]["high_loss"]["seconds_per_step"]) == {"learner_fwd"}


def test_cost_model_weighs_passes_by_their_models_flops() -> None:
    """RHO-LOSS-like counts over 10 steps of K·T = 100 tokens: a learner forward and a reference forward (a model of
    a quarter of the learner's FLOPs) over N·T = 200 tokens per step, and a one-off pretraining of 5 reference steps."""
    from bench.harness.cost_model import modelled_cost

    metrics = {"global_step": 10, "update_tokens": 1000, "selection": {
        "cost": {"learner_fwd": {"passes": 10, "tokens": 2000}, "reference_fwd": {"passes": 10, "tokens": 2000},
                 "reference_pretrain_fwd": {"passes": 5, "tokens": 500}, "reference_pretrain_bwd": {"passes": 5, "tokens": 500}},
        "flops_per_token": {"learner": 400, "reference": 100}}}
    got = modelled_cost(metrics)
    assert got["parts"] == pytest.approx({"learner_fwd": 2 / 3, "reference_fwd": 2 / 3 / 4})
    assert got["ratio"] == pytest.approx(1 + 2 / 3 + 1 / 6)
    assert got["one_off"] == pytest.approx(500 * 3 * 100 / (3 * 400 * 100))  # 1.25 plain steps
    assert modelled_cost({"global_step": 10, "update_tokens": 1000, "selection": {"kept": 5}})["ratio"] == 1.0
    del metrics["selection"]["flops_per_token"]["reference"]
    with pytest.raises(ValueError, match="flops_per_token"):
        modelled_cost(metrics)


def test_offline_prepare_reselects_when_its_inputs_change(tiny_corpus, tmp_path) -> None:
    scale = tmp_path / "tiny.yaml"
    scale.write_text(TINY_SCALE)
    recipe = tmp_path / "recipe.json"
    recipe.write_text('{"v": 1}')
    calls = []

    def counting(pool, target, budget, seed, out):
        calls.append(recipe.read_text())
        return first_docs_selector(pool, target, budget, seed, out)

    method = Method("counted", select=counting, inputs=(str(recipe),))
    plan = bench_compare.Plan(bench_compare.build_parser().parse_args(
        _args(tiny_corpus, tmp_path / "out", scale, "random")))
    first, _ = bench_compare.prepare_offline(plan, method, 0)
    bench_compare.prepare_offline(plan, method, 0)
    assert calls == ['{"v": 1}']  # cached
    recipe.write_text('{"v": 2}')
    again, _ = bench_compare.prepare_offline(plan, method, 0)
    assert calls == ['{"v": 1}', '{"v": 2}'] and again == first
    assert '{"v": 2}' in bench_compare.method_identity(plan, method)


def test_equal_wall_uses_the_interleaved_step_time_ratio(tmp_path) -> None:
    """A method 25% slower per step (in-run) is judged at random's tokens / 1.25; the run's own wall-clock is ignored."""
    from bench.harness.equal_wall import equal_wall
    from bench.harness.equal_wall import main as equal_wall_main

    def run(seed, bpbs, wall_per_token, one_off=0.0):
        tokens = [100.0 * (i + 1) for i in range(len(bpbs))]
        return {"seed": seed, "final_val_bpb": bpbs[-1], "curve": [[t, t * wall_per_token, b] for t, b in zip(tokens, bpbs)],
                "wall_seconds": tokens[-1] * wall_per_token + one_off, "one_off_seconds": one_off}

    results = {"config": {"optimizer": "muon", "ratio": 0.5}, "methods": {
        "random": {"runs": [run(0, [4.0, 3.5, 3.2, 3.0, 2.8], 1.0), run(1, [4.1, 3.6, 3.3, 3.1, 2.9], 1.0)]},
        "m": {"runs": [run(0, [3.9, 3.3, 3.0, 2.8, 2.7], 9.0, one_off=100.0), run(1, [4.0, 3.5, 3.2, 2.95, 2.85], 9.0, one_off=50.0)]},
    }}
    # random: 10 update tokens a step at 0.2 s → 50 steps, 10 s a run; m starts 3 s later than random (an in-run start-up)
    steptime = {"config": {"optimizer": "muon", "ratio": 0.5, "tokens_per_step": 10},
                "methods": {"random": {"ratio_to_random_median": 1.0, "step_ms_median": 200.0, "fixed_seconds_median": 0.5},
                            "m": {"ratio_to_random_median": 1.6, "in_run_ratio_median": 1.25, "step_ms_median": 250.0,
                                  "fixed_seconds_median": 3.5}}}
    s = equal_wall(results, steptime)["m"]
    assert s["step_time_ratio"] == 1.25  # the in-run ratio, not the run-against-run one
    # 500 tokens / 1.25 = 400 tokens: seed 0 is at 2.8 (Δ 0), seed 1 at 2.95 (Δ +0.05)
    assert s["bpb_at_random_wall"] == pytest.approx([2.8, 2.95])
    assert s["diff_mean"] == pytest.approx(0.025) and s["better_seeds"] == 0
    # random's final 2.8 reached at 400 tokens → 1.25 × 0.8; 2.9 between 400 (2.95) and 500 (2.85) → 450
    assert s["wall_to_random"] == pytest.approx([1.0, 1.25 * 0.9])
    # charged: + 3 s / 10 s of start-up, + the prepare's 100 s (50 s) over random's 500 s wall-clock in the comparison
    assert s["wall_to_random_charged"] == pytest.approx([1.0 + 0.3 + 0.2, 1.25 * 0.9 + 0.3 + 0.1])
    steptime["methods"]["m"]["in_run_ratio_median"] = None  # a timing without it: the run-against-run ratio
    assert equal_wall(results, steptime)["m"]["step_time_ratio"] == 1.6
    steptime["methods"]["m"]["in_run_ratio_median"] = 1.25
    (tmp_path / "r.json").write_text(json.dumps(results))
    steptime["config"]["optimizer"] = "adamw"
    (tmp_path / "s.json").write_text(json.dumps(steptime))
    with pytest.raises(SystemExit, match="optimizer differs"):
        equal_wall_main([str(tmp_path / "r.json"), str(tmp_path / "s.json")])

    # m timed in a later run against that run's random: its own ratio, its start-up charged against that random
    steptime["config"]["optimizer"] = "muon"
    first = {"config": steptime["config"], "methods": {"random": {**steptime["methods"]["random"], "step_ms_median": 100.0}}}
    (tmp_path / "first.json").write_text(json.dumps(first))
    (tmp_path / "s.json").write_text(json.dumps(steptime))
    later = equal_wall_main([str(tmp_path / "r.json"), str(tmp_path / "first.json"), str(tmp_path / "s.json")])["m"]
    assert later["step_time_ratio"] == 1.25
    assert later["wall_to_random_charged"] == pytest.approx(s["wall_to_random_charged"])  # 3 s over 0.2 s steps, not 0.1
    with pytest.raises(SystemExit, match="m is timed in .* and an earlier file"):
        equal_wall_main([str(tmp_path / "r.json"), str(tmp_path / "s.json"), str(tmp_path / "s.json")])
    first["config"] = {**first["config"], "tokens_per_step": 20}
    (tmp_path / "first.json").write_text(json.dumps(first))
    with pytest.raises(SystemExit, match="timed tokens_per_step 10, .* 20: give step-time files of one shape"):
        equal_wall_main([str(tmp_path / "r.json"), str(tmp_path / "first.json"), str(tmp_path / "s.json")])


def test_bench_ghost_naive_baseline_scores_what_the_engine_scores() -> None:
    """The fair baseline: vmap(grad) per-sample gradients, the same live AdamW map, the same utilities."""
    import argparse

    import torch

    from bench.studies import ghost as bench_ghost

    args = argparse.Namespace(score_len=8, layers=1, width=64, device="cpu", n=6, sketch_dim=64, engine_chunk=4, chunk=4)
    model, opt, rows = bench_ghost.setup(args)
    got = bench_ghost.prepare_engine(model, opt, rows, args)().utilities
    want = bench_ghost.prepare_naive(model, opt, rows, args)()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 * float(want.abs().max()))


def test_sketch_error_compares_block_and_shared_layouts(tmp_path) -> None:
    from bench.studies import sketch_error

    out = sketch_error.main(["--mode", "layouts", "--ms", "32,128", "--seeds", "4", "--layers", "1", "--width", "64", "--n", "4",
                             "--out", str(tmp_path / "e.json")])
    assert json.loads((tmp_path / "e.json").read_text())["per_m"] == out["per_m"]
    small, large = out["per_m"]
    for row in out["per_m"]:
        assert 0 < row["blocks_rel_error"] < 1 and 0 < row["shared_rel_error"] < 1
    assert large["blocks_rel_error"] < small["blocks_rel_error"]  # more bins per layer, less error


def test_sketch_error_over_training_stages(tmp_path) -> None:
    """The stages bench at toy size: every state has the reference and the engine's sketches, and the table."""
    from bench.studies import sketch_error

    out = sketch_error.main(["--steps", "2", "--beta2s", "0.95", "--seeds", "2", "--layers", "1", "--width", "64", "--n", "6",
                             "--m", "256", "--out", str(tmp_path / "s.json")])
    assert [(r["optimizer"], r["step"]) for r in out["states"]] == [("adamw", 2), ("muon", 2)]
    for row in out["states"]:
        assert 0 < row["count"]["abs_error"] < 1 and 0 < row["tensor"]["abs_error"] < 1
    assert {"formed", "factored"} <= set(out["states"][0]) and out["states"][0]["tensor"]["factored_layers"] == 0
    assert "| adamw | 0.95 | 2 |" in (tmp_path / "s.md").read_text()


def test_offline_variants_set_the_selector_config(tiny_corpus, tmp_path) -> None:
    """``datamask@bank.proxy_tokens=null``: the override reaches the selector, its identity and nothing else."""
    from bench.harness.offline import config_with
    from selection_callbacks.offline.datamask.selector import DatamaskConfig
    from selection_callbacks.offline.select import SelectionError

    cfg = config_with(DatamaskConfig(), [("bank.proxy_tokens", "null"), ("lam", "0.5"), ("embedder", "hashed")])
    assert cfg.bank.proxy_tokens is None and cfg.lam == 0.5 and cfg.embedder == "hashed"
    assert DatamaskConfig().bank.proxy_tokens is not None  # defaults untouched
    with pytest.raises(SelectionError, match="has no option 'proxy_token'"):
        config_with(DatamaskConfig(), [("bank.proxy_token", "1")])

    seen = []

    def recording(pool, target, budget, seed, out, overrides=()):
        seen.append(list(overrides))
        return first_docs_selector(pool, target, budget, seed, out)

    REGISTRY["recorded"] = Method("recorded", select=recording, settings=lambda ov: f"settings {ov}")
    try:
        methods, overrides = bench_compare.resolve_variants(["random", "recorded", "recorded@bank.proxy_tokens=null"])
    finally:
        del REGISTRY["recorded"]
    scale = tmp_path / "tiny.yaml"
    scale.write_text(TINY_SCALE)
    plan = bench_compare.Plan(bench_compare.build_parser().parse_args(_args(tiny_corpus, tmp_path / "o", scale, "random")))
    plan.overrides = overrides
    plain, variant = methods[1], methods[2]
    bench_compare.prepare_offline(plan, plain, 0)
    bench_compare.prepare_offline(plan, variant, 0)
    assert seen == [[], [("bank.proxy_tokens", "null")]]
    assert bench_compare.method_identity(plan, plain) != bench_compare.method_identity(plan, variant)
    assert "settings [('bank.proxy_tokens', 'null')]" in bench_compare.method_identity(plan, variant)
    assert not any(a.startswith("--selection") for a in plan.train_command(variant, 0, tmp_path / "s.parquet"))


def test_feature_bank_budget_table(tiny_corpus, tmp_path) -> None:
    from bench.studies import feature_bank as fb

    x = np.array([0.3, 1.0, np.nan, 2.0, -1.0])
    assert fb.spearman(x, x**3) == pytest.approx(1.0) and fb.spearman(x, -x) == pytest.approx(-1.0)
    out = fb.main(["--pool", tiny_corpus["pool"], "--target", tiny_corpus["target"], "--budgets", "2048",
                   "--subset-tokens", "5000", "--out", str(tmp_path / "b.json")])
    ref, noise, budget = out["rows"]
    assert ref["proxy_tokens"] is None and ref["warmup_delta_subset_kept"] == 1.0 and ref["spearman_delta"] == pytest.approx(1)
    assert noise["seed"] == 1 and noise["spearman_delta"] < 1.0
    assert budget["proxy_tokens"] == 2048 and budget["share"] < 1.0 and "| 2,048 |" in out["table"]
    assert json.loads((tmp_path / "b.json").read_text())["rows"] == out["rows"]


def test_comparison_without_a_tuned_baseline_is_refused(tiny_corpus, tmp_path) -> None:
    scale = tmp_path / "tiny.yaml"
    scale.write_text(TINY_SCALE)
    argv = [a for a in _args(tiny_corpus, tmp_path / "o", scale, "random") if a != "--allow-untuned"]
    with pytest.raises(SystemExit, match=r"no tuned baseline for scale 'tiny' under adamw.*bench.harness.tune.*--allow-untuned"):
        bench_compare.Plan(bench_compare.build_parser().parse_args(argv))
    assert bench_compare.Plan(bench_compare.build_parser().parse_args([*argv, "--allow-untuned"])).tuned is None


def test_tuned_settings_are_keyed_by_pool_and_horizon(tiny_corpus, tmp_path) -> None:
    scale = tmp_path / "tiny.yaml"
    assert bench_compare.horizon_label(32_768_000) == "32M" and bench_compare.horizon_label(768_000) == "768k"
    assert bench_compare.tuned_config(scale, "adamw").name == "tiny-adamw.yaml"
    assert bench_compare.tuned_config(scale, "adamw", "debian", 8_192_000).name == "tiny-adamw-debian-8M.yaml"
    scale.write_text(TINY_SCALE)
    argv = [a for a in _args(tiny_corpus, tmp_path / "o", scale, "random") if a != "--allow-untuned"]
    with pytest.raises(SystemExit, match=r"tiny-adamw-toy-0k.yaml is missing.*--pool-name toy --tokens"):
        bench_compare.Plan(bench_compare.build_parser().parse_args([*argv, "--pool-name", "toy"]))


def test_tune_axes_take_list_values_separated_by_semicolons() -> None:
    from bench.harness.tune import parse_axis, point_name

    assert parse_axis("model.lr=0.001,0.002") == ("model.lr", ["0.001", "0.002"])
    assert parse_axis("model.betas=[0.9,0.95];[0.9,0.99]") == ("model.betas", ["[0.9,0.95]", "[0.9,0.99]"])
    assert point_name((("model.betas", "[0.9,0.99]"),)) == "betas=[0.9,0.99]"
    with pytest.raises(SystemExit, match="key=v1,v2"):
        parse_axis("model.lr")


def test_tune_jobs_train_a_points_seeds_together_before_points_side_by_side() -> None:
    from bench.harness.tune import split_jobs

    assert split_jobs(2, 2) == (1, 2)  # 3 points × 2 seeds: never a last point alone on one of two cores
    assert split_jobs(4, 2) == (2, 2) and split_jobs(2, 3) == (1, 2) and split_jobs(3, 1) == (3, 1)
    assert split_jobs(1, 2) == (1, 1)


def test_tune_points_never_train_on_an_earlier_winner(tiny_corpus, tmp_path, monkeypatch) -> None:
    from argparse import Namespace

    from bench.harness import tune

    scale, tuned = tmp_path / "tiny.yaml", tmp_path / "tiny-adamw.yaml"
    scale.write_text(TINY_SCALE)
    monkeypatch.setattr(bench_compare, "tuned_config", lambda scale_path, optimizer, *key: tuned)
    before = bench_compare.Plan(bench_compare.build_parser().parse_args(  # the point's run before any winner existed
        _args(tiny_corpus, tmp_path / "t", scale, "random") + ["--", "--model.lr", "0.01"])).config_hash
    tuned.write_text("model:\n  lr: 0.5\n")
    plans = []
    monkeypatch.setattr(tune, "compare", lambda a: plans.append(bench_compare.Plan(a))
                        or {"methods": {"random": {"runs": [{"seed": 0, "final_val_bpb": 1.0}]}}})
    a = Namespace(out=str(tmp_path / "t"), scale=str(scale), optimizer="adamw", pool=tiny_corpus["pool"],
                  target=tiny_corpus["target"], val=tiny_corpus["val"], tokens=768, seeds="1", evals=3, threads=None,
                  pool_name=None)
    tune.run_point(a, (("model.lr", "0.01"),), seed_jobs=2)
    assert plans[0].args.jobs == 2
    cmd = plans[0].train_command(REGISTRY["random"], 0, None)
    assert plans[0].tuned is None and str(tuned) not in cmd and cmd[-2:] == ["--model.lr", "0.01"]
    assert plans[0].config_hash == before  # a sweep re-run after its winner is written reuses its runs


def test_tune_sweeps_paired_random_runs_and_compare_uses_the_winner(tiny_corpus, tmp_path, monkeypatch) -> None:
    from bench.harness import report as bench_report
    from bench.harness import tune

    scale = tmp_path / "tiny.yaml"
    scale.write_text(TINY_SCALE)
    out = tune.main(["--pool", tiny_corpus["pool"], "--target", tiny_corpus["target"], "--val", tiny_corpus["val"],
                     "--scale", str(scale), "--tokens", str(6 * 4 * 32), "--seeds", "2", "--evals", "2",
                     "--grid", "model.lr=0.0001,0.01", "--then", "model.min_lr_ratio=0.0", "--out",
                     str(tmp_path / "tune"), "--write-config", "false", "--jobs", "2"])  # a point's 2 seeds at once
    names = [r["name"] for r in out["rows"]]
    assert names == ["lr=0.0001", "lr=0.01", "lr=0.01@min_lr_ratio=0.0"] and all(len(r["bpb"]) == 2 for r in out["rows"])
    assert out["best"]["point"]["model.lr"] == "0.01"  # 6 steps at 1e-4 barely move a fresh model
    assert "**(best)**" in (tmp_path / "tune" / "tiny-adamw.md").read_text()
    tuned = tmp_path / "tiny-adamw.yaml"
    tune.write_tuned(tuned, out["best"], tmp_path / "tune" / "tiny-adamw.md")
    assert yaml.safe_load(tuned.read_text())["model"]["lr"] == 0.01
    monkeypatch.setattr(bench_compare, "tuned_config", lambda scale_path, optimizer, *key: tuned)
    plan = bench_compare.Plan(bench_compare.build_parser().parse_args(
        [a for a in _args(tiny_corpus, tmp_path / "o", scale, "random") if a != "--allow-untuned"]))
    cmd = plan.train_command(REGISTRY["random"], 0, None)
    assert cmd[cmd.index(str(tuned)) - 1] == "--config" and "lr: 0.01" in bench_report.tuning_line(plan.config)
    argv = [a for a in _args(tiny_corpus, tmp_path / "cell", scale, "random,high_loss") if a != "--allow-untuned"]
    argv[argv.index("--evals") + 1] = "2"
    cell = bench_compare.main([*argv, "--random-from", out["best"]["folder"]])  # the winner's runs are random's
    assert {r["seed"]: r["final_val_bpb"] for r in cell["methods"]["random"]["runs"]} == out["best"]["bpb"]
    assert len(list((tmp_path / "cell" / "runs").glob("*/random/seed*"))) == 0
    tuned.write_text("model:\n  lr: 0.5\n")
    argv[argv.index("--out") + 1] = str(tmp_path / "other-cell")  # another config: "cell" keeps its own
    with pytest.raises(SystemExit, match="not this comparison's random"):
        bench_compare.main([*argv, "--random-from", out["best"]["folder"]])



def test_report_lists_score_diagnostics_per_seed() -> None:
    from bench.harness.report import diagnostics_lines

    def run(rel, ratio):
        return {"diagnostics": {"checks": 10, "utility_split_half_mean": rel, "sketch_error_mean": 0.1},
                "modelled_step_ratio": ratio}
    results = {"methods": {"random": {"runs": [{"diagnostics": {}}]},
                           "opus": {"runs": [run(0.41, 1.31), run(0.52, None)]}}}
    lines = diagnostics_lines(results)
    assert lines[-2] == "| opus | 10 | 0.41, 0.52 | 0.10, 0.10 | 1.31, — |"
    assert not any(line.startswith("| random") for line in lines)
    assert diagnostics_lines({"methods": {"random": {"runs": [{"diagnostics": {}}]}}}) == []


def test_window_learnability_of_the_whole_sequence_is_the_full_ranking(tiny_corpus, tmp_path) -> None:
    from bench.studies import window_learnability

    threads = torch.get_num_threads()
    result = window_learnability.main(["--pool", tiny_corpus["pool"], "--target", tiny_corpus["target"], "--val",
                                       tiny_corpus["val"], "--steps", "2", "--windows", "128,16", "--superbatches", "3",
                                       "--reference-steps", "2", "--out", str(tmp_path / "wl")])
    assert torch.get_num_threads() == threads  # measured at one thread, the caller's setting given back
    whole, window = result["rows"]
    assert (whole["window"], whole["median_spearman"], whole["mean_top_k_overlap"]) == (128, pytest.approx(1.0), 1.0)
    assert window["window"] == 16 and -1 <= window["median_spearman"] <= 1 and window["forward_cost"] == 0.125
    assert (tmp_path / "wl.md").read_text().count("| 2 |") == 2


def test_rho_lookup_selects_as_rho_without_the_reference_forward(tiny_corpus, tmp_path) -> None:
    """The prepared table's reference is the one rho pretrains in its run: same selections, same curve; its step
    counts no reference forward, and its one-off seconds are charged to its wall-clock."""
    import pyarrow.compute as pc

    from selection_callbacks.core.ledger_store import read_ledger

    scale = tmp_path / "tiny.yaml"
    scale.write_text(TINY_SCALE)
    methods = "random,rho@reference_steps=20,rho_lookup@reference_steps=20"
    results = bench_compare.main(_args(tiny_corpus, tmp_path / "out", scale, methods, seeds="1"))
    live, looked_up = (results["methods"][m]["runs"][0] for m in ("rho@reference_steps=20", "rho_lookup@reference_steps=20"))
    picked = [read_ledger(tmp_path / "out" / r["run_dir"]).filter(pc.field("selected")).column("sample_id").to_pylist()
              for r in (live, looked_up)]
    assert picked[0] == picked[1] and len(picked[0]) == 6 * 4  # 6 steps of K = 4
    assert looked_up["final_val_bpb"] == pytest.approx(live["final_val_bpb"], abs=1e-6)
    assert looked_up["one_off_seconds"] > 0 and live["one_off_seconds"] == 0
    assert looked_up["modelled_step_ratio"] < live["modelled_step_ratio"]
    metrics = json.loads((tmp_path / "out" / looked_up["run_dir"] / "metrics.json").read_text())
    assert "reference_fwd" not in metrics["selection"]["cost"] and "learner_fwd" in metrics["selection"]["cost"]


def test_bench_registry_budget_covers_the_run(tiny_corpus, tmp_path) -> None:
    from bench.harness.methods import REGISTRY
    from bench.harness.offline import bench_select
    from selection_callbacks.data.datamodule import PoolDataModule

    assert all(REGISTRY[m].offline for m in ("dsir", "warmup_delta", "policy"))
    subset = bench_select("dsir", tiny_corpus["pool"], tiny_corpus["target"], 50 * 32, 0, tmp_path)
    dm = PoolDataModule(tiny_corpus["pool"], tiny_corpus["target"], tiny_corpus["val"], seq_len=32, batch_size=4,
                        ratio=1.0, subset=str(subset), progress=False)
    dm.prepare_data()
    dm.setup("fit")
    assert len(dm.splits["pool"]) >= 50  # the run's sequences fit in the subset


def test_stack_variants_are_train_flags_timed_against_random_on_their_stack(tiny_corpus, tmp_path) -> None:
    from bench.harness.steptime import baselines

    names = ["random", "random@model.compile=true", "opus", "opus@model.compile=true@score_len=8"]
    methods, overrides = bench_compare.resolve_variants(names)
    args = bench_compare.build_parser().parse_args(_args(tiny_corpus, tmp_path, Path("cpu-tiny"), "random"))
    plan = bench_compare.Plan(args)
    plan.overrides = overrides
    cmd = plan.train_command(methods[3], 0, None)
    assert cmd[cmd.index("--model.compile") + 1] == "true" and "--selection.init_args.model.compile" not in cmd
    assert cmd[cmd.index("--selection.init_args.score_len") + 1] == "8"
    assert baselines(names, overrides) == {"random": "random", "random@model.compile=true": "random@model.compile=true",
                                           "opus": "random", "opus@model.compile=true@score_len=8": "random@model.compile=true"}
    with pytest.raises(SystemExit, match="add random@model.compile=true to --methods"):
        baselines([names[0], names[3]], {n: overrides[n] for n in (names[0], names[3])})  # no compiled random
