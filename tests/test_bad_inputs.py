"""Bad inputs a newcomer meets, one case per test: each asserts the error text or the logged count.

Cases already handled elsewhere in the suite are repeated here in one line each, so this file is
the list of what a user can get wrong and what they are told.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch

from models.lit_gpt import LitGPT
from selection_callbacks.core.contract import SuperbatchError
from selection_callbacks.core.selection import Scores
from selection_callbacks.data.datamodule import PoolDataModule
from selection_callbacks.data.tokenizer import ByteTokenizer
from selection_callbacks.methods import (
    ClassActSelection,
    GreatsSelection,
    HighLossSelection,
    OPUSSelection,
    OracleDomainSelection,
    RandomSelection,
    RhoLossSelection,
)
from selection_callbacks.nn.gpt import GPTConfig

CFG = GPTConfig(vocab_size=320, block_size=32, n_layer=1, n_head=2, n_embd=32)
POISONED_ROW = 2
SMALL_PROXY = {"reference_steps": 2, "proxy_layers": 1, "proxy_width": 32, "proxy_heads": 2}
LOSS_METHODS = {  # every online method whose scores read the learner's per-sample loss
    "opus": lambda **kw: OPUSSelection(ratio=0.5, score_len=16, sketch_dim=64, **kw),
    "greats": lambda **kw: GreatsSelection(ratio=0.5, score_len=16, sketch_dim=64, **kw),
    "high_loss": lambda **kw: HighLossSelection(ratio=0.5, **kw),
    "rho": lambda **kw: RhoLossSelection(ratio=0.5, **SMALL_PROXY, **kw),
    "classact": lambda **kw: ClassActSelection(ratio=0.5, variant="paper", online="learner", **SMALL_PROXY, **kw),
}


class PoisonedLoss(LitGPT):
    """A learner whose scoring loss of candidate ``POISONED_ROW`` is NaN (as from inf logits)."""

    def per_sample_loss(self, batch):
        loss = super().per_sample_loss(batch)
        if loss.shape[0] > 8:  # the ghost pass: candidates then target rows
            poison = torch.ones_like(loss)
            poison[POISONED_ROW] = float("nan")
            loss = loss * poison
        return loss


class Metrics(L.Callback):
    def __init__(self) -> None:
        self.rows: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.rows.append({k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("select/")})


def _fit(corpus, callbacks, model: L.LightningModule, steps: int = 2, batch_size: int = 8, ratio: float = 0.5):
    trainer = L.Trainer(accelerator="cpu", max_steps=steps, callbacks=callbacks, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, log_every_n_steps=1)
    dm = PoolDataModule(corpus["pool"], corpus["target"], corpus["val"], seq_len=32, batch_size=batch_size,
                        ratio=ratio, progress=False)
    trainer.fit(model, datamodule=dm)
    return trainer


@pytest.mark.parametrize("method", LOSS_METHODS)
def test_a_nan_candidate_loss_is_an_error_naming_it(tiny_corpus, method) -> None:
    with pytest.raises(FloatingPointError, match=r"1 non-finite score\(s\).*check the model.s losses"):
        _fit(tiny_corpus, [LOSS_METHODS[method]()], PoisonedLoss(CFG, warmup_steps=1))


@pytest.mark.parametrize("method", LOSS_METHODS)
def test_a_nan_candidate_loss_ranks_lowest_and_is_counted(tiny_corpus, method) -> None:
    seen, selector = Metrics(), LOSS_METHODS[method](nonfinite="lowest")
    with pytest.warns(UserWarning, match="non-finite selection score"):
        _fit(tiny_corpus, [selector, seen], PoisonedLoss(CFG, warmup_steps=1), steps=3)
    assert [r["select/nonfinite"] for r in seen.rows] == [1.0] * 3
    assert torch.isfinite(selector.last_scores).all() and POISONED_ROW not in selector.last_selected.tolist()
    assert selector.last_scores[POISONED_ROW] < selector.last_scores[torch.arange(16) != POISONED_ROW].min()


def test_callback_ratio_that_disagrees_with_the_datamodule(tiny_corpus) -> None:
    with pytest.raises(ValueError, match=r"N=16 to train on K=8 \(ratio 0.5\), but RandomSelection \(ratio 0.25.*keeps K=4"):
        _fit(tiny_corpus, [RandomSelection(ratio=0.25)], LitGPT(CFG, warmup_steps=1))


def test_two_selection_callbacks_on_one_trainer(tiny_corpus) -> None:
    with pytest.raises(ValueError, match=r"2 selection callbacks \(RandomSelection, HighLossSelection\)"):
        _fit(tiny_corpus, [RandomSelection(0.5), HighLossSelection(0.5)], LitGPT(CFG, warmup_steps=1))


def test_ratio_that_rounds_to_no_row() -> None:
    with pytest.raises(SuperbatchError, match=r"ratio=0.01 of a superbatch of N=16 rounds to K=0: raise N to ≥ 50"):
        RandomSelection(ratio=0.01).keep(16)
    assert RandomSelection(ratio=0.01, k=1).keep(16) == 1


class _HeadNamedHead(torch.nn.Module):
    """A user LM whose output head is called ``head`` (no marker, untied)."""

    def __init__(self, vocab: int = 64, width: int = 16, block: int = 128) -> None:
        super().__init__()
        self.tok, self.pos = torch.nn.Embedding(vocab, width), torch.nn.Embedding(block, width)
        self.head = torch.nn.Linear(width, vocab, bias=False)
        self.fc = torch.nn.Linear(width, block)  # registered last, sized like the position table, not the vocabulary
        self.proj = torch.nn.Linear(block, width)


def test_output_head_is_found_by_structure_not_by_name() -> None:
    from selection_callbacks.nn.heads import output_heads
    from selection_callbacks.nn.optim import split_params
    from selection_callbacks.scoring.ghost.layers import scored_layers

    model = _HeadNamedHead()
    assert output_heads(model) == {"head"}
    assert [n for n, _ in scored_layers(model)] == ["fc", "proj"]
    assert [n for n, _ in scored_layers(model, include_head=True)] == ["head", "fc", "proj"]
    hidden, other2d, _ = split_params(model)
    assert any(p is model.head.weight for p in other2d) and not any(p is model.head.weight for p in hidden)
    model.head.weight = model.tok.weight  # tied: found through the tied weight, listed once
    assert output_heads(model) == {"head"} and sum(p is model.tok.weight for p in split_params(model)[1]) == 1


class _Loader:
    """One fixed dict superbatch per step (``domain`` as strings), as a user's own DataLoader might yield."""

    def __init__(self, steps: int) -> None:
        self.steps = steps

    def __iter__(self):
        for _ in range(self.steps):
            yield {"input_ids": torch.randint(0, 256, (8, 32)), "domain": ["prose"] * 6 + ["code"] * 2}

    def __len__(self) -> int:
        return self.steps


def test_domain_names_given_as_strings_reach_the_metrics() -> None:
    class Own(LitGPT):
        def train_dataloader(self):
            return _Loader(2)

    seen, selector = Metrics(), HighLossSelection(ratio=0.5)
    L.Trainer(accelerator="cpu", max_steps=2, callbacks=[selector, seen], logger=False, enable_checkpointing=False,
              enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
              log_every_n_steps=1).fit(Own(CFG, warmup_steps=1))
    # both domains are logged on every step (0 when none of it is chosen), so no share is a stale one
    assert all(r["select/domain/prose"] + r["select/domain/code"] == pytest.approx(1.0) for r in seen.rows)
    assert sum(selector.domain_counts.values()) == 8 and set(selector.domain_counts) <= {"prose", "code"}


class _TinyLM(L.LightningModule):
    """A user's own 64-token LM (not a LitGPT): embedding, one Linear, a head."""

    def __init__(self, vocab: int = 64, width: int = 16) -> None:
        super().__init__()
        self.emb, self.mix, self.out = torch.nn.Embedding(vocab, width), torch.nn.Linear(width, width), torch.nn.Linear(width, vocab)

    def per_sample_loss(self, batch):
        logits = self.out(torch.tanh(self.mix(self.emb(batch["input_ids"][:, :-1]))))
        nll = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["input_ids"][:, 1:].flatten(), reduction="none")
        return nll.view(logits.shape[0], -1).mean(1)

    def training_step(self, batch, batch_idx):
        return self.per_sample_loss(batch).mean()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class _OwnData(L.LightningDataModule):
    def __init__(self, tokenizer=None) -> None:
        super().__init__()
        if tokenizer is not None:
            self.tokenizer = tokenizer

    def train_dataloader(self):
        return [{"input_ids": torch.randint(0, 64, (8, 32))}]


def _fit_own(callback, dm, model: L.LightningModule | None = None) -> None:
    L.Trainer(accelerator="cpu", max_steps=1, callbacks=[callback], logger=False, enable_checkpointing=False,
              enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0).fit(model or _TinyLM(), datamodule=dm)


def test_text_target_file_without_the_datamodules_tokenizer(tiny_corpus) -> None:
    with pytest.raises(ValueError, match=r"target_file=.*is text and the datamodule \(_OwnData\) has no `tokenizer`"):
        _fit_own(OPUSSelection(ratio=0.5, score_len=16, target_file=tiny_corpus["target"]), _OwnData())


def test_target_file_ids_beyond_the_models_vocabulary(tiny_corpus) -> None:
    with pytest.raises(ValueError, match=r"its tokens reach id 256, but the model's vocabulary has 64 ids"):
        _fit_own(GreatsSelection(ratio=0.5, score_len=16, target_file=tiny_corpus["target"]), _OwnData(ByteTokenizer()))


def test_plain_muon_on_a_model_with_biases_names_them() -> None:
    class MuonOnMatrices(_TinyLM):
        def configure_optimizers(self):
            return torch.optim.Muon([self.mix.weight], lr=0.02)

    class Data(_OwnData):
        def target_batch(self, n, rng):
            return {"input_ids": torch.randint(0, 64, (n, 32))}

    trainer = L.Trainer(accelerator="cpu", max_steps=1, callbacks=[OPUSSelection(ratio=0.5, score_len=16)], logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0)
    with pytest.raises(ValueError, match=r"does not update: \['mix.bias'\]\. torch.optim.Muon takes only 2-D .*MuonWithAdamW"):
        trainer.fit(MuonOnMatrices(), datamodule=Data())
    import selection_callbacks

    assert selection_callbacks.MuonWithAdamW.__module__ == "selection_callbacks.nn.optim"


def test_a_non_utf8_byte_is_named_with_file_line_and_column(tiny_corpus, tmp_path) -> None:
    from selection_callbacks.data.readers import DataSourceError, check_source, iter_documents

    bad = tmp_path / "pool.jsonl"
    bad.write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9"}\n')
    for read in (check_source, lambda p: list(iter_documents(p))):
        with pytest.raises(DataSourceError, match=rf"{bad}:2: byte 0xe9 at column 14 is not UTF-8.*re-encode"):
            read(bad)
    dm = PoolDataModule(str(bad), tiny_corpus["target"], tiny_corpus["val"], seq_len=32, batch_size=8, progress=False)
    with pytest.raises(DataSourceError, match=r"pool split: .*pool.jsonl:2: byte 0xe9"):
        dm.setup("fit")


def test_a_missing_target_is_reported_before_the_pool_is_tokenized(tiny_corpus, tmp_path, monkeypatch) -> None:
    from selection_callbacks.data import datamodule as dm_mod
    from selection_callbacks.data.readers import DataSourceError

    monkeypatch.setattr(dm_mod, "pack_source", lambda *a, **k: pytest.fail("tokenized a split before checking them all"))
    dm = PoolDataModule(tiny_corpus["pool"], str(tmp_path / "nope.jsonl"), tiny_corpus["val"], seq_len=32, batch_size=8)
    for stage in (dm.prepare_data, lambda: dm.setup("fit")):
        with pytest.raises(DataSourceError, match=r"target split: data source .*nope.jsonl' does not exist"):
            stage()


class _NoLoss(L.LightningModule):
    """A user module without per_sample_loss, GPTConfig or anything else the methods look for."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.mix, self.out = torch.nn.Embedding(64, 16), torch.nn.Linear(16, 16), torch.nn.Linear(16, 64)

    def training_step(self, batch, batch_idx):
        logits = self.out(self.mix(self.emb(batch["input_ids"][:, :-1])))
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["input_ids"][:, 1:].flatten())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize(("method", "needs"), [
    (lambda: HighLossSelection(0.5), ["no per_sample_loss"]),
    (lambda: OPUSSelection(0.5, score_len=16),
     ["no per_sample_loss", "no target_batch(n, rng)", "or pass target_file=FILE"]),
    (lambda: GreatsSelection(0.5, score_len=16), ["no per_sample_loss", "no target_batch(n, rng)"]),
    (lambda: RhoLossSelection(0.5, **SMALL_PROXY), ["no per_sample_loss", "override build_proxy",
                                                    "pretrains its reference", "pass reference=CKPT"]),
    (lambda: ClassActSelection(0.5, variant="report"), ["override build_proxy"]),
    (lambda: ClassActSelection(0.5, online="learner", **SMALL_PROXY), ["no per_sample_loss", "override build_proxy",
                                                                       "target_batch"]),
    (lambda: OracleDomainSelection(0.5), ["has no domain_names"]),
])
def test_every_missing_protocol_is_named_in_one_error_before_training(method, needs) -> None:
    with pytest.raises(ValueError, match="cannot start") as info:
        _fit_own(method(), _OwnData(), model=_NoLoss())
    for need in needs:
        assert need in str(info.value), f"{need!r} missing from:\n{info.value}"


def test_opus_under_an_optimizer_it_has_no_map_for(tiny_corpus) -> None:
    class RMSpropLM(_TinyLM):
        def configure_optimizers(self):
            return torch.optim.RMSprop(self.parameters(), lr=1e-3)

    with pytest.raises(ValueError, match=r"no optimizer map for RMSprop; supported: .*optimizer's own step"):
        _fit_own(OPUSSelection(0.5, score_len=16, target_file=tiny_corpus["target"]), _OwnData(ByteTokenizer()),
                 RMSpropLM(vocab=320))


README_METHODS = {
    "RandomSelection": "RandomSelection(ratio=0.5)",
    "HighLossSelection": "HighLossSelection(ratio=0.5)",
    "OPUSSelection": "OPUSSelection(ratio=0.5, score_len=16, sketch_dim=64)",
    "GreatsSelection": "GreatsSelection(ratio=0.5, score_len=16, sketch_dim=64)",
    "RhoLossSelection": "RhoLossSelection(ratio=0.5, reference_steps=2, proxy_layers=1, proxy_width=32, proxy_heads=2)",
    "ClassActSelection": "ClassActSelection(ratio=0.5, reference_steps=2, proxy_layers=1, proxy_width=32, proxy_heads=2)",
    "ClassActSelection-report": "ClassActSelection(ratio=0.5, variant='report', proxy_layers=1, proxy_width=32, proxy_heads=2)",
    "OracleDomainSelection": "OracleDomainSelection(ratio=0.5, target_domains=['web'])",
}


@pytest.mark.parametrize("method", README_METHODS)
def test_readme_own_model_example_runs_with_every_online_method(method) -> None:
    """The own-model page's block (docs/own-model-and-data.md), executed as written with each online method as the callback."""
    from pathlib import Path

    import selection_callbacks

    readme = (Path(__file__).resolve().parents[1] / "docs" / "own-model-and-data.md").read_text()
    block = readme.split("<!-- own-model:start -->")[1].split("<!-- own-model:end -->")[0]
    code = block.split("```python")[1].split("```")[0]
    line = "callback = HighLossSelection(ratio=0.5)"
    assert line in code
    namespace: dict = {}
    exec(code.replace(line, f"callback = selection_callbacks.{README_METHODS[method]}"), {"selection_callbacks": selection_callbacks} | namespace)


ALREADY_HANDLED = {  # superbatch contract cases (their full tests are in test_contract.py)
    "not a dict": (lambda: torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randint(0, 256, (8, 32))), batch_size=8),
                   "dict batch"),
    "no input_ids": (lambda: _one({"tokens": torch.randint(0, 256, (8, 32))}), "no 'input_ids'"),
    "short per-sample entry": (lambda: _one({"input_ids": torch.randint(0, 256, (8, 32)), "sample_id": torch.arange(5)}),
                               "'sample_id' has shape"),
    "N < k": (lambda: _one({"input_ids": torch.randint(0, 256, (4, 32))}), "fewer than k=6"),
}


def _one(batch):
    return torch.utils.data.DataLoader([batch], batch_size=None)


@pytest.mark.parametrize("case", ALREADY_HANDLED)
def test_superbatch_contract_errors(case) -> None:
    loader, message = ALREADY_HANDLED[case]

    class Bare(LitGPT):
        def train_dataloader(self):
            return loader()

    selector = RandomSelection(k=6) if case == "N < k" else RandomSelection(0.5)
    with pytest.raises(SuperbatchError, match=message):
        L.Trainer(accelerator="cpu", max_steps=1, callbacks=[selector], logger=False, enable_checkpointing=False,
                  enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0).fit(Bare(CFG, warmup_steps=1))


def test_a_calibrate_returning_the_wrong_number_of_values_is_named(tiny_corpus) -> None:
    class HalfCalibrated(HighLossSelection):
        def calibrate(self, scores, k):
            return Scores(scores.values[:k])

    with pytest.raises(ValueError, match=r"HalfCalibrated\.calibrate returned values of shape torch\.Size\(\[8\]\), "
                                         r"expected \[16\]: return one value per candidate"):
        _fit(tiny_corpus, [HalfCalibrated(ratio=0.5)], LitGPT(CFG, warmup_steps=1), steps=1)


def test_ratio_outside_the_unit_interval() -> None:
    for ratio in (0.0, 1.2):
        with pytest.raises(ValueError, match=r"\(0, 1\]"):
            RandomSelection(ratio=ratio)


def test_labels_on_candidates_but_not_on_target_rows(tiny_corpus) -> None:
    class WithLabels(_OwnData):
        def train_dataloader(self):
            ids = torch.randint(0, 64, (8, 33))
            return _one({"input_ids": ids[:, :-1], "labels": ids[:, 1:]})

        def target_batch(self, n, rng):
            return {"input_ids": torch.from_numpy(rng.integers(0, 64, (n, 32)))}

    class LabelLM(_TinyLM):
        def per_sample_loss(self, batch):
            logits = self.out(torch.tanh(self.mix(self.emb(batch["input_ids"]))))
            targets = batch["labels"] if "labels" in batch else batch["input_ids"]
            return torch.nn.functional.cross_entropy(logits.transpose(1, 2), targets, reduction="none").mean(1)

    with pytest.raises(ValueError, match="the superbatch carries 'labels' and the target rows do not: candidates are "
                                         "scored against target rows, so both carry pre-shifted labels or neither"):
        _fit_own(OPUSSelection(0.5, score_len=16), WithLabels(), LabelLM())


class _Rows(_OwnData):
    """Superbatches of 8 rows (with ``extra`` entries) and target rows from ``target``; ``domain_names`` for the oracle."""

    domain_names = ["web", "code"]

    def __init__(self, target=None, **extra) -> None:
        super().__init__()
        self.target, self.extra = target, extra

    def train_dataloader(self):
        return _one({"input_ids": torch.randint(0, 64, (8, 32)), "sample_id": torch.arange(8),
                     "domain": torch.arange(8) % 2, **self.extra})

    def target_batch(self, n, rng):
        return self.target(n, rng) if self.target else {"input_ids": torch.from_numpy(rng.integers(0, 64, (n, 32)))}


_NAN_MASK = torch.ones(8, 32)
_NAN_MASK[3, 30] = float("nan")
FIT_CHECKS = {  # checks before the first step and per superbatch (full tests: tests/callbacks/test_fit_checks.py)
    "empty target split": (lambda: RhoLossSelection(0.5, **SMALL_PROXY),
                           {"target": lambda n, rng: {"input_ids": torch.zeros(0, 32, dtype=torch.long)}},
                           r"target_batch\(n, rng\) returned no rows .*the target split is empty"),
    "1-D target rows": (lambda: RhoLossSelection(0.5, **SMALL_PROXY),
                        {"target": lambda n, rng: {"input_ids": torch.zeros(32, dtype=torch.long)}},
                        r"returned 'input_ids' of shape \(32,\): each token entry is a 2-D tensor"),
    "undeclared per-sample array": (lambda: HighLossSelection(0.5), {"weight": torch.ones(8).numpy()},
                                    r"'weight' has N=8 rows but is not declared .*per_sample_keys"),
    "undeclared tensor of length N": (lambda: HighLossSelection(0.5), {"class_weights": torch.ones(8)},
                                      r"'class_weights' has N=8 rows but is not declared .*whole_batch_keys"),
    "NaN outside the scored rows": (lambda: HighLossSelection(0.5), {"loss_mask": _NAN_MASK},
                                    r"1 candidate\(s\) hold NaN/inf in \['loss_mask'\], e.g. samples \[3\]"),
    "oracle without target domains": (lambda: OracleDomainSelection(0.5), {},
                                      r"has no such split: pass target_domains=\[...\]"),
    "loader that cannot resume": (lambda: HighLossSelection(0.5, strict_resume=True), {},
                                  r"the train loader \(DataLoader\) cannot restore its position"),
}


@pytest.mark.parametrize("case", FIT_CHECKS)
def test_fit_checks_name_cause_and_fix(case) -> None:
    method, data, message = FIT_CHECKS[case]
    with pytest.raises((ValueError, FloatingPointError), match=message):
        _fit_own(method(), _Rows(**data))
