"""The checks every method makes before its first step and per superbatch, in real Trainer runs on a user's own
LightningModule and DataModule: target rows, the first superbatch, declared per-sample keys, non-finite rows,
superbatch sizes, the oracle's domains and a Hugging Face learner without its config."""

from __future__ import annotations

import random
import warnings

import lightning as L
import numpy as np
import pytest
import torch
from torch import nn

from selection_callbacks.callbacks import base as base_module
from selection_callbacks.callbacks.fit_checks import drawn_target_rows
from selection_callbacks.callbacks.protocols import TargetUse
from selection_callbacks.core.contract import SuperbatchError
from selection_callbacks.core.rng import micro_batch_generator
from selection_callbacks.methods import (
    ClassActSelection,
    HighLossSelection,
    OPUSSelection,
    OracleDomainSelection,
    RandomSelection,
    RhoLossSelection,
)

T, N, VOCAB = 64, 16, 320
SMALL = {"reference_steps": 2, "proxy_layers": 1, "proxy_width": 32, "proxy_heads": 2}
TARGET_READERS = {  # the methods that read target rows, and the alternative each error names
    "rho": (lambda: RhoLossSelection(ratio=0.5, **SMALL), "pass reference=CKPT"),
    "classact": (lambda: ClassActSelection(ratio=0.5, **SMALL), "pass reference=CKPT"),
    "opus": (lambda: OPUSSelection(ratio=0.5, score_len=16, sketch_dim=64), "pass target_file=FILE"),
}


class TinyLM(L.LightningModule):
    """A user's own learner; ``losses`` holds every training step's loss."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.mix, self.head = nn.Embedding(VOCAB, 32), nn.Linear(32, 32), nn.Linear(32, VOCAB)
        self.losses: list[float] = []
        self.rows: list[dict[str, int]] = []

    def per_sample_loss(self, batch) -> torch.Tensor:
        ids = batch["input_ids"]
        nll = nn.functional.cross_entropy(self.head(torch.relu(self.mix(self.embed(ids[:, :-1])))).transpose(1, 2),
                                          ids[:, 1:], reduction="none")
        mask = batch.get("loss_mask")
        if mask is None:
            return nll.mean(1)
        mask = mask[:, 1:].to(nll.dtype)
        return (nll * mask).sum(1) / mask.sum(1).clamp_min(1)

    def training_step(self, batch, batch_idx):
        self.rows.append({key: len(value) for key, value in batch.items()})
        loss = self.per_sample_loss(batch).mean()
        self.losses.append(float(loss))
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def superbatches(count: int = 4, rows: int = N, seed: int = 0, **extra) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for s in range(count):
        batch = {"input_ids": torch.randint(0, 256, (rows, T), generator=g), "sample_id": torch.arange(s * rows, (s + 1) * rows)}
        out.append({**batch, **{key: make(s) for key, make in extra.items()}})
    return out


class Loader:
    """The given superbatches, one per step (a sized iterable: Lightning knows the epoch's last)."""

    def __init__(self, batches: list[dict]) -> None:
        self.batches = batches

    def __iter__(self):
        for batch in self.batches:
            yield {key: value.clone() if isinstance(value, torch.Tensor) else value for key, value in batch.items()}

    def __len__(self) -> int:
        return len(self.batches)


class MyData(L.LightningDataModule):
    batch_size, ratio = 8, 0.5
    vocab_size, seq_len = VOCAB, T

    def __init__(self, batches: list[dict] | None = None, target=None) -> None:
        super().__init__()
        self.batches, self.target = batches or superbatches(), target

    def train_dataloader(self):
        return Loader(self.batches)

    def target_batch(self, n: int, rng: np.random.Generator) -> dict[str, torch.Tensor]:
        if self.target is not None:
            return self.target(n, rng)
        return {"input_ids": torch.from_numpy(rng.integers(0, 256, (n, T)))}


def fit(callbacks, dm: L.LightningDataModule, model: L.LightningModule | None = None, steps: int = 2) -> L.LightningModule:
    model = model or TinyLM()
    L.Trainer(accelerator="cpu", max_steps=steps, callbacks=list(callbacks), logger=False, enable_checkpointing=False,
              enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0).fit(model, datamodule=dm)
    return model


# ---- target rows, checked when the fit starts ----
@pytest.mark.parametrize("method", TARGET_READERS)
def test_an_empty_target_split_is_named_before_the_first_step(method) -> None:
    make, instead = TARGET_READERS[method]
    model = TinyLM()
    with pytest.raises(ValueError, match=r"target_batch\(n, rng\) returned no rows \('input_ids' of shape \(0, 64\)\): "
                                         rf"the target split is empty; give it at least one sequence .*; or {instead}"):
        fit([make()], MyData(target=lambda n, rng: {"input_ids": torch.zeros(0, T, dtype=torch.long)}), model)
    assert model.losses == []


@pytest.mark.parametrize(("target", "message"), [
    (lambda n, rng: {"input_ids": torch.from_numpy(rng.integers(0, 256, (T,)))},
     r"returned 'input_ids' of shape \(64,\): each token entry is a 2-D tensor \[n, T\]"),
    (lambda n, rng: torch.zeros(n, T, dtype=torch.long), r"returned a Tensor: return a dict of \[n, T\] tensors"),
    (lambda n, rng: {"input_ids": torch.full((n, T), 400)},
     r"holds 'input_ids' up to id 400, beyond the learner's vocabulary of 320 ids: tokenize it with the learner's"),
    (lambda n, rng: {"input_ids": torch.zeros(n, T, dtype=torch.long), "loss_mask": torch.full((n, T), float("nan"))},
     r"returned non-finite 'loss_mask' values in rows \[0, 1\]: a mask holds a finite weight"),
])
def test_target_rows_a_method_cannot_use_are_named_before_the_first_step(target, message) -> None:
    with pytest.raises(ValueError, match=r"OPUSSelection draws its target rows from the target split, but the "
                                         r"datamodule's "
                                         rf"\(MyData\) target_batch\(n, rng\) {message}"):
        fit([OPUSSelection(ratio=0.5, score_len=16, sketch_dim=64)], MyData(target=target))


@pytest.mark.parametrize("method", [
    lambda: RandomSelection(0.5), lambda: HighLossSelection(0.5),
    lambda: ClassActSelection(0.5, variant="report", proxy_layers=1, proxy_width=32, proxy_heads=2)])
def test_methods_that_read_no_target_rows_draw_none(method) -> None:
    calls = []
    fit([method()], MyData(target=lambda n, rng: calls.append(n) or {"input_ids": torch.zeros(0, T, dtype=torch.long)}))
    assert calls == []


class GlobalRngTarget(MyData):
    """Target rows drawn from the global torch, numpy and Python RNGs as well as the given generator (a user's
    datamodule may do this); ``drawn`` records every draw of n ≥ 8 rows (the methods' own)."""

    def __init__(self) -> None:
        super().__init__()
        self.drawn: list[torch.Tensor] = []

    def target_batch(self, n, rng):
        ids = (torch.randint(0, 256, (n, T)) + int(np.random.randint(3)) + random.randrange(3) + rng.integers(3)) % 256
        if n >= 8:
            self.drawn.append(ids)
        return {"input_ids": ids}


def test_the_target_check_moves_no_row_a_method_draws_later(monkeypatch) -> None:
    """OPUS under a datamodule that reads the global RNGs draws the same target rows and selects the same candidates
    with the fit-start draw as without it."""
    runs = []
    for check in (True, False):
        if not check:
            monkeypatch.setattr(base_module, "drawn_target_rows", lambda *a: (None, []))
        torch.manual_seed(0), np.random.seed(0), random.seed(0)
        dm, selector, chosen = GlobalRngTarget(), OPUSSelection(ratio=0.5, score_len=16, sketch_dim=64), []
        original = selector.after_selection
        selector.after_selection = lambda t, m, record: (chosen.append(record.selected.tolist()), original(t, m, record))
        model = fit([selector], dm, steps=3)
        runs.append((dm.drawn, chosen, model.losses))
    (rows, chosen, losses), (rows_unchecked, chosen_unchecked, losses_unchecked) = runs
    # the capture pass's draw at fit start, then one per step
    assert len(rows) == 4 and all(torch.equal(a, b) for a, b in zip(rows, rows_unchecked, strict=True))
    assert chosen == chosen_unchecked and losses == losses_unchecked


def test_the_target_draw_leaves_the_global_rng_states_as_they_were() -> None:
    dm = GlobalRngTarget()
    before = (torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate())
    uses = [TargetUse("OPUSSelection", "reads", "pass target_file=FILE")]
    rows, problems = drawn_target_rows(uses, dm, VOCAB, seed=0)
    assert problems == [] and rows["input_ids"].shape == (2, T)
    assert torch.equal(torch.get_rng_state(), before[0]) and (np.random.get_state()[1] == before[1]).all()
    assert random.getstate() == before[2]


# ---- the first superbatch ----
def test_superbatch_ids_beyond_the_vocabulary_are_named_before_the_first_selection() -> None:
    batches = superbatches()
    batches[0]["input_ids"][3, 5] = 500
    with pytest.raises(SuperbatchError, match=r"HighLossSelection cannot select from the first superbatch:\n- the "
                                              r"superbatch holds 'input_ids' up to id 500, beyond the learner's vocabulary of 320"):
        fit([HighLossSelection(0.5)], MyData(batches))


def test_the_first_superbatch_and_the_target_rows_carry_the_same_kind_of_mask() -> None:
    batches = superbatches(loss_mask=lambda s: torch.ones(N, T))
    def target(n, rng):
        return {"input_ids": torch.from_numpy(rng.integers(0, 256, (n, T))),
                "loss_mask": torch.ones(n, T, dtype=torch.bool)}
    with pytest.raises(SuperbatchError, match=r"the superbatch's 'loss_mask' is torch.float32 and the target rows' is "
                                              "torch.bool: give both the same dtype"):
        fit([OPUSSelection(ratio=0.5, score_len=16, sketch_dim=64)], MyData(batches, target))


# ---- declared per-sample keys ----
class Declared(MyData):
    per_sample_keys = ("weight", "tags")
    whole_batch_keys = ("class_weights",)


def test_declared_entries_are_cut_to_k_and_whole_batch_entries_pass_uncut() -> None:
    batches = superbatches(weight=lambda s: np.arange(N, dtype=np.float32) + 100 * s, tags=lambda s: [f"t{i}" for i in range(N)],
                           class_weights=lambda s: torch.ones(N), extra=lambda s: torch.arange(N + 1))
    seen = []

    class Spy(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            seen.append(batch)

    model = fit([HighLossSelection(0.5), Spy()], Declared(batches))
    assert model.rows == [{"input_ids": 8, "sample_id": 8, "weight": 8, "tags": 8, "class_weights": N, "extra": N + 1}] * 2
    for step, batch in enumerate(seen):  # the declared rows are those of the kept candidates
        kept = (batch["sample_id"] - step * N).numpy()
        assert (batch["weight"] == kept + 100 * step).all() and batch["tags"] == [f"t{i}" for i in kept]


def test_keys_the_callback_declares_join_the_datamodules() -> None:
    batches = superbatches(weight=lambda s: torch.rand(N), score_hint=lambda s: torch.rand(N))
    model = fit([HighLossSelection(0.5, per_sample_keys=["weight"], whole_batch_keys=["score_hint"])], MyData(batches))
    assert model.rows[0] == {"input_ids": 8, "sample_id": 8, "weight": 8, "score_hint": N}


def test_a_declared_entry_with_other_rows_than_n_is_an_error() -> None:
    with pytest.raises(SuperbatchError, match=r"'weight' has shape \(5,\), expected first dimension N=16: a per-sample "
                                              "entry holds one row per candidate"):
        fit([HighLossSelection(0.5)], Declared(superbatches(weight=lambda s: np.ones(5))))


def test_a_key_declared_both_ways_is_an_error() -> None:
    with pytest.raises(ValueError, match=r"\['weight'\] is declared both per-sample and whole-batch"):
        fit([HighLossSelection(0.5, whole_batch_keys=["weight"])], Declared())


# ---- non-finite rows ----
def _nan_outside_the_window(row: int, seed: int = 0, score_len: int = 16) -> list[dict]:
    """Superbatches with a NaN in row ``row``'s loss_mask at a position outside the window OPUS scores of it."""
    batches = superbatches(loss_mask=lambda s: torch.ones(N, T))
    for step, batch in enumerate(batches):
        offsets = torch.randint(0, T - score_len + 1, (N,), generator=micro_batch_generator(seed, 0, step, "window"))
        start = int(offsets[row])
        batch["loss_mask"][row, start + score_len if start + score_len < T else start - 1] = float("nan")
    return batches


def test_a_nan_outside_the_scored_window_is_an_error_naming_the_entry_and_sample() -> None:
    with pytest.raises(FloatingPointError, match=r"OPUSSelection: 1 candidate\(s\) hold NaN/inf in \['loss_mask'\], e.g. "
                                                 r"samples \[2\]: training on such a row makes the step's loss non-finite"):
        fit([OPUSSelection(ratio=0.5, score_len=16, sketch_dim=64)], MyData(_nan_outside_the_window(row=2)))


@pytest.mark.parametrize("method", [lambda: OPUSSelection(ratio=0.5, score_len=16, sketch_dim=64, nonfinite="lowest"),
                                    lambda: RandomSelection(0.5)])
def test_a_row_with_a_nan_is_never_chosen_under_lowest(method) -> None:
    """The issue's case (OPUS, ``nonfinite='lowest'``, a NaN in loss_mask outside the 16-token window): the row is left
    out of every choice and every step's loss is finite; a rule that draws at random leaves it out too."""
    selector = method()
    selector.nonfinite = "lowest"  # RandomSelection's constructor takes no nonfinite
    chosen = []
    original = selector.after_selection
    selector.after_selection = lambda t, m, record: (chosen.append(record.sample_id[record.selected].tolist()),
                                                     original(t, m, record))
    with pytest.warns(UserWarning, match=r"candidates with NaN/inf in \['loss_mask'\] are left out of the choice"):
        model = fit([selector], MyData(_nan_outside_the_window(row=2)), steps=4)
    assert len(chosen) == 4 and not any(step * N + 2 in ids for step, ids in enumerate(chosen))
    assert all(np.isfinite(model.losses)) and len(model.losses) == 4


def test_fewer_finite_rows_than_k_is_an_error() -> None:
    batches = superbatches(loss_mask=lambda s: torch.ones(N, T))
    batches[0]["loss_mask"][:10, 0] = float("inf")
    selector = HighLossSelection(0.5, nonfinite="lowest")
    with pytest.raises(FloatingPointError, match=r"10 of the 16 candidates hold NaN/inf, which leaves 6 to keep K=8"):
        fit([selector], MyData(batches))


# ---- superbatch sizes ----
class Partial(L.LightningDataModule):
    """40 rows in superbatches of 16 (the last of each epoch has 8), without batch_size/ratio."""

    def train_dataloader(self):
        rows = [{"input_ids": torch.randint(0, 256, (T,)), "sample_id": torch.tensor(i)} for i in range(40)]
        return torch.utils.data.DataLoader(rows, batch_size=16)


def test_a_datamodule_without_batch_size_and_ratio_and_a_partial_batch_are_named_once() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = fit([RandomSelection(0.5)], Partial(), steps=6)
    messages = [str(w.message) for w in caught]
    assert sum("the datamodule (Partial) declares no batch_size/ratio: the superbatch's N cannot be checked" in m
               for m in messages) == 1
    size = [m for m in messages if "a superbatch of N=8 candidates (the others have N=16" in m]
    assert len(size) == 1 and "trains K=4 rows instead of K=8: rows per step change; pass short_superbatch='drop'" in size[0]
    assert [r["input_ids"] for r in model.rows] == [8, 8, 4, 8, 8, 4]


def test_drop_keeps_k_fixed_by_dropping_each_epochs_partial_batch() -> None:
    model = fit([HighLossSelection(0.5, short_superbatch="drop")], Partial(), steps=5)
    assert [r["input_ids"] for r in model.rows] == [8] * 5  # epochs of 2 steps: the 8-row batches never train


def test_drop_refuses_a_short_superbatch_mid_epoch() -> None:
    batches = superbatches(count=3)
    batches[1] = {key: value[:12] for key, value in batches[1].items()}
    with pytest.raises(SuperbatchError, match=r"a superbatch of N=12 candidates arrived mid-epoch \(the others have N=16\); "
                                              "short_superbatch='drop' drops only an epoch's last"):
        fit([HighLossSelection(0.5, short_superbatch="drop")], MyData(batches), steps=3)


# ---- the oracle's domains ----
class Domains(MyData):
    domain_names = ["web", "code"]

    def __init__(self) -> None:
        super().__init__(superbatches(domain=lambda s: torch.arange(N) % 2))


@pytest.mark.parametrize(("target_domains", "message"), [
    (None, r"prefers the target split's domains, read from datamodule.splits\['target'\].domain_names, and the "
           r"datamodule \(Domains\) has no such split: pass target_domains=\[...\] \(names from its domain_names "
           r"\['web', 'code'\]\)"),
    (["prose"], r"target_domains \['prose'\] are not among the domain_names \['web', 'code'\] of the datamodule"),
])
def test_the_oracle_checks_its_domains_before_the_first_step(target_domains, message) -> None:
    with pytest.raises(ValueError, match=message):
        fit([OracleDomainSelection(0.5, target_domains=target_domains)], Domains())


def test_the_oracle_with_its_domains_named_selects_them_first() -> None:
    selector = OracleDomainSelection(0.5, target_domains=["code"])
    fit([selector], Domains())
    assert selector.domain_counts == {"code": 16}


def test_the_oracle_takes_the_base_checks_options() -> None:
    with pytest.raises(ValueError, match=r"OracleDomainSelection: the train loader \(Loader\) cannot restore its position"):
        fit([OracleDomainSelection(0.5, target_domains=["code"], strict_resume=True)], Domains())


# ---- a Hugging Face learner ----
def _llama(with_config: bool) -> L.LightningModule:
    from transformers import LlamaConfig, LlamaForCausalLM

    class Wrapped(TinyLM):
        def __init__(self) -> None:
            super().__init__()
            self.model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2))
            if with_config:
                self.config = self.model.config

    return Wrapped()


@pytest.mark.parametrize("with_config", [False, True])
def test_a_hugging_face_learner_without_its_config_is_named_when_proxies_fall_back(with_config) -> None:
    selector = RhoLossSelection(ratio=0.5, **SMALL)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit([selector], MyData(), _llama(with_config), steps=1)
    named = [str(w.message) for w in caught if "builds its proxies as the plugin's GPT" in str(w.message)]
    proxy = type(selector.reference.proxy.module.config).__name__
    if with_config:
        assert named == [] and proxy == "LlamaConfig"
    else:
        assert proxy == "GPTConfig" and named[0] == (
            "RhoLossSelection builds its proxies as the plugin's GPT: Wrapped holds a Hugging Face LlamaForCausalLM at "
            "'model' but has no `config` of its own; set `self.config = self.model.config` in its __init__ to build "
            "them as LlamaConfig's architecture")


@pytest.mark.parametrize("method", ["RandomSelection", "HighLossSelection", "OracleDomainSelection", "RhoLossSelection",
                                    "ClassActSelection", "OPUSSelection", "GreatsSelection"])
def test_every_method_takes_the_fit_options(method: str) -> None:
    import selection_callbacks

    selector = getattr(selection_callbacks, method)(strict_resume=True, short_superbatch="drop",
                                                     per_sample_keys=["weight"], whole_batch_keys=["meta"])
    assert (selector.strict_resume, selector.short_superbatch) == (True, "drop")
    assert (selector.per_sample_keys, selector.whole_batch_keys) == (["weight"], ["meta"])
