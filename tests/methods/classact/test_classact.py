"""ClassAct with real tiny models: scores, proxy training and its cost, precision, resume and errors."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from models.lit_gpt import LitGPT
from selection_callbacks.core.costs import CostMeter
from selection_callbacks.core.rng import micro_batch_generator
from selection_callbacks.data.datamodule import PoolDataModule
from selection_callbacks.methods import ClassActSelection
from selection_callbacks.nn.gpt import GPTConfig
from selection_callbacks.scoring.proxy_models import Proxy, seeded_proxy
from selection_callbacks.scoring.reference import load_reference
from selection_callbacks.scoring.windows import score_windows
from tests.support.learnability import SEQ_LEN, assert_learnability_order, trained_models

TINY_PROXY = {"proxy_layers": 1, "proxy_width": 32, "proxy_heads": 2}
LEARNER = GPTConfig(vocab_size=320, block_size=SEQ_LEN, n_layer=1, n_head=2, n_embd=32)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return trained_models(tmp_path_factory.mktemp("classact"))


class Capture(L.Callback):
    """Per micro-batch: selected and candidate ids, scores, the proxies' weights after their update, metrics."""

    def __init__(self, selector: ClassActSelection) -> None:
        self.selector = selector
        self.ids: list[list[int]] = []
        self.candidates: list[list[int]] = []
        self.scores: list[torch.Tensor] = []
        self.weights: list[dict[str, dict[str, torch.Tensor]]] = []
        self.metrics: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        record = self.selector.last_record
        self.ids.append(record.sample_id[record.selected].tolist())
        self.candidates.append(record.sample_id.tolist())
        self.scores.append(record.scores)
        self.weights.append({n: copy.deepcopy(p.module.state_dict()) for n, p in self.selector.proxies.items()})
        self.metrics.append({k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("select/")})


def _fit(corpus: dict[str, str], selector: ClassActSelection, steps: int, learner: LitGPT | None = None,
         root: Path | None = None, ckpt_every: int | None = None, ckpt_path: str | None = None,
         precision: str = "32-true") -> Capture:
    """Fit (N = 32, K = 16, T = 32) with ``selector``; checkpoints every ``ckpt_every`` steps into ``root``."""
    torch.manual_seed(0)
    seen = Capture(selector)
    callbacks: list[L.Callback] = [selector, seen]
    if ckpt_every:
        callbacks.append(ModelCheckpoint(dirpath=root, every_n_train_steps=ckpt_every, save_top_k=-1))
    trainer = L.Trainer(accelerator="cpu", max_steps=steps, callbacks=callbacks, logger=False, precision=precision,
                        enable_checkpointing=bool(ckpt_every), enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, log_every_n_steps=1)
    dm = PoolDataModule(corpus["pool"], corpus["target"], corpus["val"], seq_len=SEQ_LEN, batch_size=16, ratio=0.5,
                        seed=3, progress=False)
    trainer.fit(learner or LitGPT(LEARNER, warmup_steps=1), datamodule=dm, ckpt_path=ckpt_path)
    return seen


@pytest.mark.parametrize("sampling, temperature", [("top_k", 1.0), ("gumbel", 0.05)])
def test_paper_variant_scores_where_the_math_says(trained: dict, sampling: str, temperature: float) -> None:
    """online = the learner, reference = the checkpoint trained on the target split."""
    selector = ClassActSelection(ratio=0.5, variant="paper", online="learner", reference=str(trained["ckpt"]),
                                 sampling=sampling, temperature=temperature)
    trainer = L.Trainer(accelerator="cpu", max_steps=1, callbacks=[selector], logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0)
    corpus = trained["corpus"]
    dm = PoolDataModule(corpus["pool"], corpus["target"], corpus["val"], seq_len=SEQ_LEN, batch_size=32, ratio=0.5,
                        progress=False)
    trainer.fit(copy.deepcopy(trained["learner"]), datamodule=dm)
    reference = load_reference(trained["ckpt"])
    assert_learnability_order(selector.last_record, dm.domain_names, trained["learner"], reference)
    assert selector.proxies == {} and selector.reference.kind == "checkpoint" and selector.reference.ready


def test_report_variant_trains_both_proxies_on_their_rows(tiny_corpus) -> None:
    """Same initial weights; online: one AdamW step on the K selected rows, reference: on all N at 2× the lr."""
    selector = ClassActSelection(ratio=0.5, variant="report", proxy_lr=2e-3, seed=4, **TINY_PROXY)
    seen = _fit(tiny_corpus, selector, steps=3)
    assert torch.count_nonzero(seen.scores[0]) == 0  # identical proxies: nothing learned yet
    assert seen.scores[2].std() > 0
    online, reference = selector.proxies["online"], selector.proxies["reference"]
    assert online.steps == reference.steps == 3
    assert reference.optimizer.param_groups[0]["lr"] == 2 * online.optimizer.param_groups[0]["lr"] == 4e-3

    # replay step 0 by hand from the recorded candidates and choice
    pool = PoolDataModule(tiny_corpus["pool"], tiny_corpus["target"], tiny_corpus["val"], seq_len=SEQ_LEN,
                          progress=False)
    pool.setup()
    for name, lr, ids in [("online", 2e-3, seen.ids[0]), ("reference", 4e-3, seen.candidates[0])]:
        replay = Proxy(name, seeded_proxy(online.module.config, 4, "proxy"), CostMeter(), lr=lr)
        replay.train_step(pool.splits["pool"].batch(ids))
        for key, value in replay.module.state_dict().items():
            torch.testing.assert_close(seen.weights[0][name][key], value)


def test_windows_are_scored_and_trained_on_alike(tiny_corpus) -> None:
    """score_len = 8: both proxies score each candidate's seeded 8-token window and train on those windows (the
    online proxy on the K selected, the reference on all N); every proxy pass reads 8 tokens a row."""
    selector = ClassActSelection(ratio=0.5, variant="report", proxy_lr=2e-3, seed=4, score_len=8, **TINY_PROXY)
    seen = _fit(tiny_corpus, selector, steps=2)
    pool = PoolDataModule(tiny_corpus["pool"], tiny_corpus["target"], tiny_corpus["val"], seq_len=SEQ_LEN,
                          progress=False)
    pool.setup()
    config = selector.proxies["online"].module.config
    replay = {name: Proxy(name, seeded_proxy(config, 4, "proxy"), CostMeter(), lr=lr)
              for name, lr in [("online", 2e-3), ("reference", 4e-3)]}
    for step in range(2):
        gen = micro_batch_generator(selector.seed, 0, step, "window")
        windows = score_windows(pool.splits["pool"].batch(seen.candidates[step]), 8, gen)
        assert windows["input_ids"].shape == (32, 8)
        with torch.no_grad():
            want = replay["online"].losses(windows) - replay["reference"].losses(windows)
        torch.testing.assert_close(seen.scores[step], want.float(), rtol=1e-4, atol=1e-5)
        kept = torch.tensor([seen.candidates[step].index(i) for i in seen.ids[step]])
        replay["online"].train_step({k: v[kept] for k, v in windows.items()})
        replay["reference"].train_step(windows)
        for name, proxy in replay.items():
            for key, value in proxy.module.state_dict().items():
                torch.testing.assert_close(seen.weights[step][name][key], value)
    step = seen.metrics[-1]
    assert step["select/cost/online_fwd_tokens"] == (32 + 16) * 8 and step["select/cost/reference_bwd_tokens"] == 32 * 8
    with pytest.raises(ValueError, match="score_len must be ≥ 1"):
        ClassActSelection(score_len=0)


def test_report_variant_cost_accounting(tiny_corpus) -> None:
    selector = ClassActSelection(ratio=0.5, variant="report", **TINY_PROXY)
    seen = _fit(tiny_corpus, selector, steps=3)
    N, K, T = 32, 16, SEQ_LEN
    step = seen.metrics[-1]
    # online: scoring forward over N + training forward/backward over K; reference: over N and N
    assert step["select/cost/online_fwd_tokens"] == (N + K) * T and step["select/cost/online_bwd_tokens"] == K * T
    assert step["select/cost/reference_fwd_tokens"] == 2 * N * T and step["select/cost/reference_bwd_tokens"] == N * T
    assert step["select/cost/online_fwd"] == 2 and step["select/cost/reference_bwd"] == 1
    assert step["select/cost/fwd_per_update"] == (N + K + 2 * N) / K
    assert step["select/cost/bwd_per_update"] == (K + N) / K
    assert step["select/cost/reference_bwd_tokens_total"] == 3 * N * T and step["select/cost/online_fwd_total"] == 6
    assert "select/cost/learner_fwd" not in step  # the report variant never runs the learner to score
    assert "select/scoring_fraction" not in seen.metrics[0] and 0 < step["select/scoring_fraction"] <= 1
    assert selector.summary()["cost"]["online_bwd"] == {"passes": 3, "tokens": 3 * K * T}


@pytest.mark.parametrize("kwargs", [
    {"variant": "report"},
    {"variant": "paper", "online": "proxy", "reference_steps": 3, "reference_batch_size": 4},
], ids=["report", "paper-online-proxy"])
def test_resume_selects_the_same_ids(tiny_corpus, tmp_path: Path, kwargs: dict[str, Any]) -> None:
    """Stopped after step 5, resumed from its step-3 checkpoint: proxies, their optimizers and counters come back."""
    def make() -> ClassActSelection:
        return ClassActSelection(ratio=0.5, seed=1, sampling="gumbel", temperature=0.1, **TINY_PROXY, **kwargs)

    full_selector = make()
    full = _fit(tiny_corpus, full_selector, steps=8)
    _fit(tiny_corpus, make(), steps=5, root=tmp_path / "ckpt", ckpt_every=3)
    resumed_selector = make()
    resumed = _fit(tiny_corpus, resumed_selector, steps=8, ckpt_path=str(tmp_path / "ckpt" / "epoch=0-step=3.ckpt"))
    assert resumed.ids == full.ids[3:]
    assert len({tuple(ids) for ids in full.ids}) == 8
    pairs = [(proxy, resumed_selector.proxies[name]) for name, proxy in full_selector.proxies.items()]
    if full_selector.reference is not None:  # the paper variant's frozen reference, pretrained before the checkpoint
        pairs.append((full_selector.reference.proxy, resumed_selector.reference.proxy))
        assert resumed_selector.reference.ready and resumed_selector.reference.proxy.steps == 3
    for proxy, resumed_proxy in pairs:
        assert resumed_proxy.steps == proxy.steps
        for key, value in proxy.module.state_dict().items():
            torch.testing.assert_close(resumed_proxy.module.state_dict()[key], value, rtol=0, atol=0)
    assert resumed_selector.meter.total == full_selector.meter.total  # the reference was not pretrained again
    assert resumed_selector.selections == full_selector.selections == 8


@pytest.mark.parametrize("precision, weights", [("bf16-mixed", torch.float32), ("bf16-true", torch.bfloat16)])
def test_proxies_run_under_the_learners_precision(tiny_corpus, precision: str, weights: torch.dtype) -> None:
    selector = ClassActSelection(ratio=0.5, variant="report", **TINY_PROXY)
    seen_dtypes: set[torch.dtype] = set()

    class Hook(L.Callback):
        def on_train_start(self, trainer, pl_module) -> None:
            for proxy in selector.proxies.values():
                proxy.module.model.lm_head.register_forward_hook(lambda m, i, out: seen_dtypes.add(out.dtype))

    torch.manual_seed(0)
    trainer = L.Trainer(accelerator="cpu", max_steps=2, callbacks=[selector, Hook()], logger=False, precision=precision,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0)
    dm = PoolDataModule(tiny_corpus["pool"], tiny_corpus["target"], tiny_corpus["val"], seq_len=SEQ_LEN, batch_size=16,
                        ratio=0.5, progress=False)
    trainer.fit(LitGPT(LEARNER, warmup_steps=1), datamodule=dm)
    assert seen_dtypes == {torch.bfloat16}  # scoring and training forwards
    assert {p.dtype for proxy in selector.proxies.values() for p in proxy.module.parameters()} == {weights}
    assert selector.proxies["online"].steps == 2


def test_clear_errors(tiny_corpus, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="paper variant needs a reference"):
        ClassActSelection(variant="paper", reference_steps=0)
    with pytest.raises(ValueError, match="report variant trains both proxies online"):
        ClassActSelection(variant="report", reference="ref.ckpt")
    with pytest.raises(ValueError, match="report variant trains both proxies online"):
        ClassActSelection(variant="report", online="learner")
    with pytest.raises(ValueError, match="samples by 'top_k' or 'gumbel'"):
        ClassActSelection(sampling="uniform")
    with pytest.raises(FloatingPointError, match="online proxy's .* diverged .* lower the proxy learning rate"):
        _fit(tiny_corpus, ClassActSelection(ratio=0.5, variant="report", proxy_lr=1e30, **TINY_PROXY), steps=3)
    with pytest.raises(FileNotFoundError, match="reference checkpoint"):
        _fit(tiny_corpus, ClassActSelection(ratio=0.5, reference=str(tmp_path / "none.ckpt"), **TINY_PROXY), steps=1)
