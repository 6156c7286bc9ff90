"""A reference of one's own: RHO-LOSS scores with a LitGPT checkpoint, a LitCausalLM checkpoint or a Hugging Face
folder exactly as with the same weights handed over as an nn.Module, never changes them, refuses another
vocabulary and pickled code, scores an overridden build_proxy() as built with reference_steps=0, and looks a
table's losses up by sample_id with a DataModule of its own."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from torch import nn

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # configs only: nothing is downloaded

from models import LitCausalLM  # noqa: E402
from models.hf_causal_lm import causal_lm_config  # noqa: E402
from models.lit_gpt import LitGPT  # noqa: E402
from selection_callbacks.core.safe_load import UnsafeLoadError  # noqa: E402
from selection_callbacks.core.selection import SelectionRecord  # noqa: E402
from selection_callbacks.data.datamodule import PoolDataModule  # noqa: E402
from selection_callbacks.methods import ClassActSelection, RhoLossSelection  # noqa: E402
from selection_callbacks.nn.gpt import GPTConfig  # noqa: E402
from selection_callbacks.scoring.reference import LogitsLM, Reference, load_reference  # noqa: E402
from selection_callbacks.scoring.reference_losses import ReferenceLossTable  # noqa: E402
from tests.core.test_safe_load import CreatesAFile, crafted  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
SEQ_LEN = 32
LEARNER = GPTConfig(vocab_size=320, block_size=SEQ_LEN, n_layer=1, n_head=2, n_embd=32)


class Records(L.Callback):
    """Each micro-batch's selection record (scores, chosen rows, the candidate rows)."""

    def __init__(self, selector: RhoLossSelection) -> None:
        self.selector, self.records = selector, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.records.append(self.selector.last_record)


def _fit(selector, datamodule: L.LightningDataModule, learner: L.LightningModule,
         steps: int = 2) -> list[SelectionRecord]:
    records = Records(selector)
    trainer = L.Trainer(accelerator="cpu", max_steps=steps, callbacks=[selector, records], logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0)
    trainer.fit(learner, datamodule=datamodule)
    return records.records


def _learner() -> LitGPT:
    torch.manual_seed(0)
    return LitGPT(LEARNER, warmup_steps=1)


def _pool(corpus: dict[str, str], ratio: float = 0.5) -> PoolDataModule:
    return PoolDataModule(corpus["pool"], corpus["target"], corpus["val"], seq_len=SEQ_LEN, batch_size=8, ratio=ratio,
                          seed=0, progress=False)


def _checkpoint(model: L.LightningModule, corpus: dict[str, str], path: Path) -> Path:
    """A real Lightning checkpoint of ``model`` after one training step (no selection)."""
    trainer = L.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0)
    trainer.fit(model, datamodule=_pool(corpus, ratio=1.0))
    trainer.save_checkpoint(path)
    return path


def _tiny_llama():
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1)
    return AutoModelForCausalLM.from_config(causal_lm_config(str(ROOT / "configs/model/tiny-llama.yaml")))


def _lit_gpt_checkpoint(corpus, tmp_path):
    torch.manual_seed(2)
    path = _checkpoint(LitGPT(GPTConfig(vocab_size=320, block_size=SEQ_LEN, n_layer=2, n_head=2, n_embd=32),
                              warmup_steps=1), corpus, tmp_path / "gpt.ckpt")
    return path, LitGPT.load_from_checkpoint(path)


def _lit_causal_lm_checkpoint(corpus, tmp_path):
    torch.manual_seed(3)
    path = _checkpoint(LitCausalLM(str(ROOT / "configs/model/tiny-llama.yaml"), warmup_steps=1), corpus,
                       tmp_path / "llama.ckpt")
    return path, LitCausalLM.load_from_checkpoint(path)


def _pretrained_folder(corpus, tmp_path):
    model = _tiny_llama()
    model.save_pretrained(tmp_path / "llama")
    torch.save({"payload": CreatesAFile(tmp_path / "made")}, tmp_path / "llama" / "pytorch_model.bin")
    return tmp_path / "llama", model  # with a pickle beside the safetensors that must never be unpickled


def _plain(state: dict[str, torch.Tensor], wrapped: bool) -> dict[str, torch.Tensor]:
    """A scoring module's weights under the names of the module it wraps (:class:`LogitsLM` holds it as ``model``)."""
    return {key.removeprefix("model."): value for key, value in state.items()} if wrapped else state


@pytest.mark.parametrize("make", [_lit_gpt_checkpoint, _lit_causal_lm_checkpoint, _pretrained_folder],
                         ids=["LitGPT-checkpoint", "LitCausalLM-checkpoint", "save_pretrained-folder"])
def test_each_reference_form_scores_as_its_weights_given_as_a_module(tiny_corpus, tmp_path: Path, make) -> None:
    source, module = make(tiny_corpus, tmp_path)
    before = {k: v.clone() for k, v in module.state_dict().items()}
    flags = [p.requires_grad for p in module.parameters()]
    runs = {}
    for form, reference in (("source", str(source)), ("module", module)):
        selector = RhoLossSelection(ratio=0.5, reference=reference, reference_steps=300)  # as rho.yaml sets it: unused
        runs[form] = (selector, _fit(selector, _pool(tiny_corpus), _learner()))
    (by_source, seen_source), (by_module, seen_module) = runs["source"], runs["module"]
    for a, b in zip(seen_source, seen_module, strict=True):
        assert torch.equal(a.scores, b.scores) and torch.equal(a.selected, b.selected)
    # the module handed over is left as it was; both references scored frozen, untrained, with its weights
    assert all(torch.equal(v, before[k]) for k, v in module.state_dict().items())
    assert [p.requires_grad for p in module.parameters()] == flags
    wrapped = isinstance(by_source.reference.proxy.module, LogitsLM)
    for selector in (by_source, by_module):
        reference = selector.reference
        assert reference.ready and reference.proxy.steps == 0 and reference.steps == 0
        assert "reference_pretrain_fwd" not in selector.meter.total
        assert selector.meter.total["reference_fwd"][0] == 2
        state = _plain(reference.proxy.module.state_dict(), wrapped)
        assert state.keys() == before.keys() and all(torch.equal(state[k], before[k]) for k in before)
    assert by_source.reference.kind == ("folder" if Path(source).is_dir() else "checkpoint")
    assert by_module.reference.kind == "module"
    assert not (tmp_path / "made").exists()  # the folder's pickled pytorch_model.bin was never unpickled

    first = seen_source[0].batch  # scored before the learner's first step: ℓ_learner − ℓ_reference, brute force
    scorer = module if hasattr(module, "per_sample_loss") else LogitsLM(module)
    with torch.no_grad():
        want = _learner().per_sample_loss(first) - scorer.eval().per_sample_loss(first)
    torch.testing.assert_close(seen_source[0].scores, want.float(), rtol=1e-5, atol=1e-5)


def test_classact_takes_a_folder_as_its_paper_reference(tiny_corpus, tmp_path: Path) -> None:
    folder, model = _pretrained_folder(tiny_corpus, tmp_path)
    classact = ClassActSelection(ratio=0.5, online="learner", reference=str(folder))
    rho = RhoLossSelection(ratio=0.5, reference=model)
    for a, b in zip(_fit(classact, _pool(tiny_corpus), _learner()), _fit(rho, _pool(tiny_corpus), _learner()),
                    strict=True):
        assert torch.equal(a.scores, b.scores)  # online = the learner: RHO-LOSS's score, with the same weights
    assert classact.reference.kind == "folder" and classact.proxies == {}


class OwnData(L.LightningDataModule):
    """Superbatches of N = 16 random rows with sparse sample ids; no target split."""

    vocab_size, seq_len, batch_size, ratio = 320, SEQ_LEN, 8, 0.5

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        self.seed = seed

    def train_dataloader(self):
        g = torch.Generator().manual_seed(self.seed)
        rows = [{"input_ids": torch.randint(0, 256, (16, SEQ_LEN), generator=g),
                 "sample_id": 1000 + 7 * torch.arange(16 * b, 16 * (b + 1))} for b in range(4)]
        return torch.utils.data.DataLoader(rows, batch_size=None)


class OwnDataWithTarget(OwnData):
    def target_batch(self, n: int, rng) -> dict:
        return {"input_ids": torch.from_numpy(rng.integers(0, 256, (n, SEQ_LEN)))}


class OwnBuilder(RhoLossSelection):
    """RHO-LOSS whose reference starts from a model of one's own (``build_proxy``)."""

    def __init__(self, trained: nn.Module, **kwargs) -> None:
        self.trained = trained
        super().__init__(**kwargs)

    def build_proxy(self, trainer, pl_module, purpose: str) -> nn.Module:
        return copy.deepcopy(self.trained)


CHILD = r"""
import sys
sys.modules["models"] = None  # `import models` (and every models.*) raises ImportError here, as in an installed wheel
import torch
from selection_callbacks.scoring.reference import load_reference
ids = torch.load(sys.argv[2])
reference = load_reference(sys.argv[1])
assert not any(name == "models" or name.startswith("models.") for name in sys.modules if sys.modules[name] is not None)
torch.save(reference.per_sample_loss({"input_ids": ids}), sys.argv[3])
"""


@pytest.mark.parametrize("make", [_lit_gpt_checkpoint, _lit_causal_lm_checkpoint], ids=["LitGPT", "LitCausalLM"])
def test_a_checkpoint_is_read_where_models_cannot_be_imported(tiny_corpus, tmp_path: Path, make) -> None:
    """A LitLanguageModel checkpoint loads as a reference in a process that cannot import ``models/`` (which an
    installed wheel lacks) and scores as the module the test loaded with it."""
    path, module = make(tiny_corpus, tmp_path)
    ids = torch.randint(0, 320, (4, SEQ_LEN), generator=torch.Generator().manual_seed(0))
    torch.save(ids, tmp_path / "ids.pt")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", CHILD, str(path), str(tmp_path / "ids.pt"), str(tmp_path / "out.pt")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    with torch.no_grad():
        expected = load_reference(module).per_sample_loss({"input_ids": ids})
    torch.testing.assert_close(torch.load(tmp_path / "out.pt"), expected)


def _trained_gpt(vocab: int = 320) -> LitGPT:
    torch.manual_seed(5)
    return LitGPT(GPTConfig(vocab_size=vocab, block_size=SEQ_LEN, n_layer=1, n_head=2, n_embd=32))


def test_reference_steps_zero_scores_build_proxy_as_built_and_steps_train_it(tmp_path: Path) -> None:
    trained = _trained_gpt()
    before = {k: v.clone() for k, v in trained.state_dict().items()}
    with pytest.raises(ValueError, match="RhoLossSelection needs a reference"):
        RhoLossSelection(ratio=0.5, reference_steps=0)  # the default builder's proxy is untrained
    selector = OwnBuilder(trained, ratio=0.5, reference_steps=0)
    records = _fit(selector, OwnData(), _learner())  # OwnData has no target split: none is needed
    with torch.no_grad():
        want = _learner().per_sample_loss(records[0].batch) - trained.per_sample_loss(records[0].batch)
    torch.testing.assert_close(records[0].scores, want.float(), rtol=1e-5, atol=1e-5)
    reference = selector.reference
    assert reference.kind == "built" and reference.ready and reference.proxy.steps == 0
    assert all(torch.equal(v, before[k]) for k, v in reference.proxy.module.state_dict().items())

    asked = OwnBuilder(trained, ratio=0.5, reference_steps=2, reference_batch_size=4)  # the way to fine-tune it
    _fit(asked, OwnDataWithTarget(), _learner(), steps=1)
    assert asked.reference.proxy.steps == 2 and asked.meter.total["reference_pretrain_bwd"][0] == 2
    tuned = asked.reference.proxy.module.state_dict()
    assert not all(torch.equal(tuned[k], before[k]) for k in before)
    assert all(torch.equal(v, before[k]) for k, v in trained.state_dict().items())  # its own copy trained


def test_a_vocabulary_other_than_the_learners_is_refused_before_the_first_step() -> None:
    selector = RhoLossSelection(ratio=0.5, reference=_trained_gpt(vocab=384))
    with pytest.raises(ValueError, match="has vocab_size=384 and the learner has vocab_size=320"):
        _fit(selector, OwnData(), _learner())
    assert selector.selections == 0

    class Undeclared(nn.Module):  # scores, but says nothing of its vocabulary
        def __init__(self) -> None:
            super().__init__()
            self.head = nn.Linear(1, 1)

        def per_sample_loss(self, batch):
            return batch["input_ids"].float().mean(1)

    message = "Undeclared module given as the reference declares no vocabulary, .* learner's 320 token ids: give it"
    with pytest.raises(ValueError, match=message):
        _fit(RhoLossSelection(ratio=0.5, reference=Undeclared()), OwnData(), _learner())


def test_reference_losses_keyed_by_sample_id_with_a_datamodule_of_ones_own(tmp_path: Path) -> None:
    reference = _trained_gpt()
    path = ReferenceLossTable.of_batches(reference, OwnData().train_dataloader(), progress=False).write(
        tmp_path / "losses.npz")
    table = ReferenceLossTable.read(path)
    assert table.fingerprint is None and table.sample_id.tolist() == sorted(1000 + 7 * i for i in range(64))
    selector = RhoLossSelection(ratio=0.5, reference_losses=str(path))
    records = _fit(selector, OwnData(), _learner())
    with torch.no_grad():
        want = _learner().per_sample_loss(records[0].batch) - reference.per_sample_loss(records[0].batch)
    torch.testing.assert_close(records[0].scores, want.float(), rtol=1e-5, atol=1e-5)
    assert "reference_fwd" not in selector.meter.total  # looked up: no reference forward

    other = RhoLossSelection(ratio=0.5, reference_losses=str(path))
    with pytest.raises(ValueError, match=r"the rows of sample_id\(s\) \[1000, 1007, .* hold other tokens"):
        _fit(other, OwnData(seed=1), _learner())  # the same ids, other tokens
    assert other.selections == 0


def test_a_checkpoint_whose_unpickling_runs_code_is_refused_and_runs_nothing(tmp_path: Path) -> None:
    path, made = crafted(tmp_path, "reference")
    with pytest.raises(UnsafeLoadError, match="holds objects that loading would have to build"):
        _fit(RhoLossSelection(ratio=0.5, reference=str(path)), OwnData(), _learner())
    folder = tmp_path / "pickled"
    folder.mkdir()
    _tiny_llama().config.to_json_file(folder / "config.json")
    torch.save({"payload": CreatesAFile(made)}, folder / "pytorch_model.bin")
    with pytest.raises(ValueError, match="holds no \\*.safetensors weights .* never loaded"):
        _fit(RhoLossSelection(ratio=0.5, reference=str(folder)), OwnData(), _learner())
    assert not made.exists()


def test_a_resumed_reference_must_be_of_the_kind_it_was_started_with() -> None:
    built = Reference(None, steps=3)
    given = Reference(_trained_gpt(), steps=300)
    assert given.steps == 0 and not given.trains and built.trains
    with pytest.raises(ValueError, match="checkpoint's reference is of kind 'built' .* resume with the reference"):
        given.load_state_dict(built.state_dict())


def test_the_own_reference_page_runs_as_written(tmp_path: Path, monkeypatch) -> None:
    """docs/own-model-and-data.md: the own-reference block, executed after the own-model block's learner and data."""
    from tests.test_readme import python_block

    page = ROOT / "docs" / "own-model-and-data.md"
    namespace: dict = {}
    exec(python_block(page, "<!-- own-model:start -->").split("callback = HighLossSelection")[0], namespace)
    monkeypatch.chdir(tmp_path)
    exec(python_block(page, "<!-- own-reference:start -->"), namespace)
    assert (tmp_path / "reference_losses.npz").is_file()
    assert namespace["callback"].selections == 2 and namespace["callback"].reference.kind == "built"
