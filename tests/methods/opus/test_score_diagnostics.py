"""OPUS's score diagnostics: split-half reliability, the probed sketch error and the kept share of each domain."""

from __future__ import annotations

import json
import random
import statistics
from pathlib import Path

import lightning as L
import pytest
import torch
from scipy.stats import spearmanr

from selection_callbacks.core.rank_correlation import spearman
from selection_callbacks.methods import OPUSSelection
from selection_callbacks.nn.gpt import GPT
from selection_callbacks.scoring.ghost.engine import GhostEngine, take_rows
from selection_callbacks.scoring.losses import mean_token_losses
from selection_callbacks.scoring.maps.step_maps import OptimizerStepMaps
from selection_callbacks.scoring.reliability import split_half_reliability
from tests.conftest import write_jsonl
from tests.methods.opus.test_opus import CFG, _fit
from tests.support.wandb_fit import wandb_fit


@pytest.mark.parametrize("ties", [False, True])
def test_spearman_is_scipys(ties: bool) -> None:
    g = torch.Generator().manual_seed(0)
    a = torch.randint(0, 4, (40,), generator=g).double() if ties else torch.randn(40, generator=g, dtype=torch.float64)
    b = a + torch.randn(40, generator=g, dtype=torch.float64)
    b[3] = float("nan")  # left out with its pair
    keep = torch.isfinite(b)
    assert spearman(a, b) == pytest.approx(spearmanr(a[keep].numpy(), b[keep].numpy()).statistic, abs=1e-12)


def test_split_halves_partition_the_target_rows() -> None:
    """Under the frozen AdamW map the utility is linear in ḡ, so the halves' utilities average back to the
    full batch's: u = (|A| u^A + |B| u^B) / P, and the reliability is the Spearman of exactly those two."""
    torch.manual_seed(0)
    model = GPT(CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 256, (11, 17))
    rows = {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}  # 4 candidates, 7 target rows: halves of 3 and 4
    for _ in range(3):  # moments to precondition by
        opt.zero_grad()
        mean_token_losses(model)(rows).mean().backward()
        opt.step()
    loss_fn, engine = mean_token_losses(model), GhostEngine(model)
    full = engine.score(loss_fn, rows, 4, OptimizerStepMaps(opt)).utilities
    first = engine.score(loss_fn, take_rows(rows, torch.tensor([0, 1, 2, 3, 4, 5, 6]), 11), 4, OptimizerStepMaps(opt)).utilities
    second = engine.score(loss_fn, take_rows(rows, torch.tensor([0, 1, 2, 3, 7, 8, 9, 10]), 11), 4, OptimizerStepMaps(opt)).utilities
    torch.testing.assert_close((3 * first + 4 * second) / 7, full, rtol=1e-4, atol=1e-6)
    got = split_half_reliability(engine, loss_fn, rows, 4, lambda: OptimizerStepMaps(opt))
    assert got == pytest.approx(spearman(first, second))
    with pytest.raises(ValueError, match="≥ 2 target rows"):
        split_half_reliability(engine, loss_fn, take_rows(rows, torch.arange(5), 11), 4, lambda: OptimizerStepMaps(opt))


@pytest.fixture(scope="module")
def random_bytes_target(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Documents of uniformly random ASCII bytes (1..127): no domain of the pool, no structure to share."""
    rng = random.Random(0)
    docs = [{"id": f"r{i}", "text": "".join(chr(rng.randrange(1, 128)) for _ in range(400))} for i in range(40)]
    return str(write_jsonl(tmp_path_factory.mktemp("target") / "random_bytes.jsonl", docs))


def test_reliability_is_higher_when_target_and_candidates_share_a_domain(tiny_corpus, random_bytes_target: str) -> None:
    """The target split (prose, half the pool's candidates) ranks candidates more consistently across its two
    halves than a target file of random bytes does; both measured on every selection of a 20-step AdamW run."""
    means = {}
    for name, target_file in (("target", None), ("random bytes", random_bytes_target)):
        selector = OPUSSelection(ratio=0.5, score_len=16, sketch_dim=256, diagnostics_every=1, target_file=target_file)
        _fit(tiny_corpus, selector, steps=20, batch_size=16)
        assert len(selector.diagnostics) == 20
        means[name] = statistics.mean(c["utility_split_half"] for c in selector.diagnostics)
    assert means["target"] > means["random bytes"] + 0.1, means


class Chosen(L.Callback):
    """The selected positions of every micro-batch."""

    def __init__(self, selector: OPUSSelection) -> None:
        self.selector, self.chosen = selector, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.chosen.append(self.selector.last_selected.tolist())


def test_diagnostics_never_change_a_selection(tiny_corpus) -> None:
    runs = []
    for diagnose in (True, False):
        selector = OPUSSelection(ratio=0.5, score_len=16, sketch_dim=256, diagnostics_every=1, reliability=diagnose,
                                 sketch_check=4 if diagnose else 0)
        seen = Chosen(selector)
        _fit(tiny_corpus, selector, steps=6, extra=[seen])
        runs.append((seen.chosen, selector))
    (with_chosen, with_selector), (without_chosen, without_selector) = runs
    assert with_chosen == without_chosen
    assert all(c.keys() == {"step", "utility_split_half", "sketch_error", "sketch_norm_bias"} for c in with_selector.diagnostics)
    assert all(c.keys() == {"step"} for c in without_selector.diagnostics)
    # scoring: (N + P)·L = 24·16 tokens forward and backward per step; the halves add (N + P/2)·L twice
    assert with_selector.summary()["cost"]["learner_reached_bwd"] == {"passes": 12, "tokens": 6 * (24 * 16 + 2 * 20 * 16)}
    assert without_selector.summary()["cost"]["learner_fwd"] == {"passes": 6, "tokens": 6 * 24 * 16}
    summary = with_selector.summary()["diagnostics"]
    assert summary["checks"] == 6 and [c["step"] for c in summary["history"]] == [0, 1, 2, 3, 4, 5]
    assert summary["utility_split_half_mean"] == pytest.approx(statistics.mean(c["utility_split_half"] for c in summary["history"]))


def test_diagnostic_selections_are_every_nth_and_survive_a_resume() -> None:
    selector = OPUSSelection(ratio=0.5, diagnostics_every=3)
    due = []
    for _ in range(7):
        due.append(selector.diagnostic_call())
        selector._count(16, 8, 0.0)
    assert due == [True, False, False, True, False, False, True]
    selector.diagnostics = [{"step": 0.0, "utility_split_half": 0.5}]
    resumed = OPUSSelection(ratio=0.5, diagnostics_every=3)
    resumed.load_state_dict(selector.state_dict())
    assert resumed.diagnostic_call() == selector.diagnostic_call() and resumed.diagnostics == selector.diagnostics
    with pytest.raises(ValueError, match="target_batch_size must be ≥ 2"):
        OPUSSelection(target_batch_size=1)
    with pytest.raises(ValueError, match="diagnostics_every must be ≥ 1"):
        OPUSSelection(diagnostics_every=0)


def test_diagnostics_reach_metrics_json_and_an_offline_wandb_run(tiny_corpus, tmp_path: Path, monkeypatch) -> None:
    """train.py with OPUS and the W&B logger: the split-half Spearman is logged on every 2nd step, the run
    summary and metrics.json hold the diagnostics and each domain's kept fraction."""
    cli, logged = wandb_fit(tiny_corpus, tmp_path, monkeypatch, "opus", ["--selection.init_args.diagnostics_every", "2"])
    run = cli.trainer.logger.experiment
    try:
        steps = [d["trainer/global_step"] for d in logged if "select/utility_split_half" in d]
        assert steps == [0, 2, 4]
        summary = {key: run.summary[key] for key in run.summary.keys()}
        assert summary["selection/diagnostics/checks"] == 3
        assert -1 <= summary["selection/diagnostics/utility_split_half_mean"] <= 1
        assert 0 < summary["selection/diagnostics/sketch_error_mean"] < 1
        assert set(k for k in summary if k.startswith("selection/domain_kept_fraction/")) == {
            "selection/domain_kept_fraction/prose", "selection/domain_kept_fraction/noise"}
        assert not any(k.startswith("selection/diagnostics/history") for k in summary)
    finally:
        run.finish()
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())["selection"]
    assert [c["step"] for c in metrics["diagnostics"]["history"]] == [0, 2, 4]
    kept = metrics["domain_kept_fraction"]
    shares = metrics["domains"]
    assert set(kept) == {"prose", "noise"} and sum(shares.values()) == pytest.approx(1.0)
    assert all(0 <= v <= 1 for v in kept.values())
