"""OPUS and GREATS on the nine Hugging Face families a learner may be built from (Llama, Mistral, Qwen2, Qwen3,
GPT-2, GPT-NeoX, OLMo 2, Phi-3, Gemma 2; ``configs/model/tiny-*.yaml``): each method's own engine and step maps
against per-sample gradients from torch.func, on the hidden layers (the methods' default, where GPT-NeoX's
parallel residual needs a second root) and on every layer (the embedding and head too: Gemma 2's scaled and tied
table); the roots of the scoring backward; a padding row; and the wirings the capture cannot serve, refused by
name before the first step."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch
import torch.nn as nn

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # configs only: nothing is downloaded

from models import LitCausalLM  # noqa: E402
from models.hf_causal_lm import causal_lm_config  # noqa: E402
from selection_callbacks.data.datamodule import PoolDataModule  # noqa: E402
from selection_callbacks.methods import GreatsSelection, OPUSSelection  # noqa: E402
from selection_callbacks.nn.optim import build_optimizer  # noqa: E402
from selection_callbacks.scoring.ghost.engine import GhostEngine  # noqa: E402
from selection_callbacks.scoring.ghost.roots import Roots  # noqa: E402
from selection_callbacks.scoring.maps.step_maps import OptimizerStepMaps  # noqa: E402
from tests.support.per_sample_gradients import assert_utilities_match, brute_force, per_sample_grads  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
ARCHITECTURES = ["llama", "mistral", "qwen2", "qwen3", "gpt2", "gpt-neox", "olmo2", "phi3", "gemma2"]
N_CAND, N_TARGET, T = 5, 3, 8
METHODS = {"opus": OPUSSelection, "greats": GreatsSelection}


def _learner(name: str, **fields) -> LitCausalLM:
    torch.manual_seed(0)
    config = causal_lm_config(str(ROOT / f"configs/model/tiny-{name}.yaml"))
    for key, value in fields.items():
        setattr(config, key, value)
    return LitCausalLM(config)


def _rows(n: int = N_CAND + N_TARGET, seed: int = 1, high: int = 256) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, high, (n, T + 1), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}


def _trained(lit: LitCausalLM, optimizer: str, steps: int = 2) -> torch.optim.Optimizer:
    """``steps`` steps of AdamW, or of Muon+AdamW by the split rule, so the maps read real moments."""
    opt = build_optimizer(lit.model, optimizer, 3e-3, 0.1, (0.9, 0.95), 0.02, 0.95, 0.01)
    for step in range(steps):
        opt.zero_grad()
        lit.per_sample_loss(_rows(8, seed=100 + step)).mean().backward()
        opt.step()
    return opt


@pytest.mark.parametrize("method, optimizer", [("opus", "adamw"), ("opus", "muon"), ("greats", "adamw")])
@pytest.mark.parametrize("name", ARCHITECTURES)
def test_method_utilities_match_per_sample_gradients(name: str, method: str, optimizer: str) -> None:
    """The method's own engine (its setup on the learner) and step maps (OPUS: the live optimizer's, AdamW or
    Muon+AdamW; GREATS: SGD's η·I at the optimizer's lr) give, per layer, u_i = Σ ⟨G_i, −Jᵀḡ⟩ of the per-sample
    gradients G_i: on the hidden layers and on every layer (embedding and head; a tied table once)."""
    lit = _learner(name)
    opt = _trained(lit, optimizer)
    batch = _rows()
    G = per_sample_grads(lit.model, batch)
    trainer = SimpleNamespace(precision_plugin=None, optimizers=[opt], accumulate_grad_batches=1, world_size=1)
    for every_layer in (False, True):
        selection = METHODS[method](include_embedding=every_layer, include_head=every_layer, sketch_dim=0, reliability=False)
        selection.setup(trainer, lit, "fit")
        maps = selection.step_maps(trainer, N_CAND // 2)
        got = selection.engine.score(lit.per_sample_loss, batch, N_CAND, maps)
        layers = [(n, m) for n, m in selection.engine.layers if n not in got.shared]
        want, _ = brute_force(lit.model, G, maps, layers, N_CAND)
        assert_utilities_match(got, want)
        kinds = {type(m).__name__ for _, m in layers}
        assert ".mlp." in " ".join(got.layer_utilities) and (every_layer == any("Embedding" in k for k in kinds))


def test_parallel_residual_scores_every_block_from_two_roots() -> None:
    """GPT-NeoX with use_parallel_residual (Pythia): the first block's MLP reads the block's input, not the attention's
    output, so its input is a second root; without the parallel residual one root reaches every layer. Scoring only
    the second block stops the backward there (its input, one root)."""
    counts = {}
    for parallel in (True, False):
        lit = _learner("gpt-neox", use_parallel_residual=parallel)
        engine = GhostEngine(lit.model)
        got = engine.score(lit.per_sample_loss, _rows(), N_CAND, OptimizerStepMaps(torch.optim.SGD(lit.parameters(), lr=0.1)))
        assert len(got.layer_utilities) == 8 and all(torch.isfinite(u).all() for u in got.layer_utilities.values())
        counts[parallel] = sorted(engine.capture.root_inputs)
    assert counts[True] == ["gpt_neox.layers.0.attention.query_key_value", "gpt_neox.layers.0.mlp.dense_h_to_4h"]
    assert counts[False] == ["gpt_neox.layers.0.attention.query_key_value"]
    lit = _learner("gpt-neox")
    late = GhostEngine(lit.model, exclude=tuple(n for n, _ in GhostEngine(lit.model).layers if ".layers.0." in n))
    late.score(lit.per_sample_loss, _rows(), N_CAND, OptimizerStepMaps(torch.optim.SGD(lit.parameters(), lr=0.1)))
    assert sorted(late.capture.root_inputs) == ["gpt_neox.layers.1.attention.query_key_value",
                                                 "gpt_neox.layers.1.mlp.dense_h_to_4h"]


def test_roots_reach_what_is_computed_from_them() -> None:
    """A tensor computed from a root is reached; a parallel branch is not until it is a root; a sibling output of the
    root's own node (a split) is not taken for the root; a leaf root is reached through its AccumulateGrad."""
    x = torch.randn(4, 6, requires_grad=True)
    h = x * 2
    roots = Roots()
    roots.add(h)
    assert roots.reaches(h) and roots.reaches((h + 1).relu() @ torch.ones(6, 3))
    branch = x.sin()
    assert not roots.reaches(branch) and not roots.reaches(x)
    roots.add(branch)
    assert roots.reaches(branch.exp() + h)
    first, second = (x * 3).split(3, dim=1)
    roots.add(first)
    assert roots.reaches(first * 2) and not roots.reaches(second) and not roots.reaches(second * 2)
    leaf_roots = Roots()
    leaf_roots.add(x)
    assert leaf_roots.reaches(second * 2) and not leaf_roots.reaches(torch.randn(3, requires_grad=True) * 2)


def test_a_padding_row_takes_no_gradient() -> None:
    """A table with a padding id (OLMo 2's class default, 1) gives that row no gradient: the rows that look it up
    score as the per-sample gradients say."""
    lit = _learner("olmo2", pad_token_id=1)
    assert lit.model.model.embed_tokens.padding_idx == 1
    batch = _rows(high=4)  # ids 0..3: the padding id on about a quarter of the tokens
    opt = _trained(lit, "adamw")
    maps = OptimizerStepMaps(opt)
    engine = GhostEngine(lit.model, include_embedding=True)
    got = engine.score(lit.per_sample_loss, batch, N_CAND, maps)
    want, _ = brute_force(lit.model, per_sample_grads(lit.model, batch), maps, engine.layers, N_CAND)
    assert_utilities_match(got, want)


class _ShiftedEmbedding(nn.Embedding):
    """A table whose forward adds a constant to the looked-up rows: not a scaled lookup."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(ids) + 1.0


def test_a_table_forward_that_is_not_a_scaled_lookup_is_refused() -> None:
    lit = _learner("llama", tie_word_embeddings=False)
    table = lit.model.model.embed_tokens
    shifted = _ShiftedEmbedding(table.num_embeddings, table.embedding_dim)
    lit.model.model.embed_tokens = shifted
    engine = GhostEngine(lit.model, include_embedding=True)
    with pytest.raises(TypeError, match=r"embedding 'model.embed_tokens' \(_ShiftedEmbedding\) overrides "
                                        r"nn.Embedding.forward.*include_embedding=False"):
        engine.score(lit.per_sample_loss, _rows(), N_CAND, OptimizerStepMaps(torch.optim.SGD(lit.parameters(), lr=0.1)))


class _Detached(nn.Module):
    """Runs a Linear but hands on its output detached: the loss has no gradient in its weight."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.inner = nn.Linear(width, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.inner(x).detach()


def _miswired(name: str = "gpt-neox") -> LitCausalLM:
    """The learner with one scored Linear that never runs and one whose output is detached from the loss."""
    lit = _learner(name, use_parallel_residual=True)
    lit.model.gpt_neox.unused = nn.Linear(64, 64)
    block = lit.model.gpt_neox.layers[1]
    block.attention.dense = nn.Sequential(block.attention.dense, _Detached(64))
    return lit


def test_layers_the_capture_cannot_serve_are_named_with_their_cause() -> None:
    lit = _miswired()
    engine = GhostEngine(lit.model)
    problems = engine.capture_problems(lit.per_sample_loss, _rows())
    assert len(problems) == 2
    assert "1 scored layer(s) did not run in the per-sample loss's forward" in problems[0]
    assert "['gpt_neox.unused']" in problems[0] and "layers=[...]" in problems[0]
    assert "ran in the forward but their output gradients never arrived: ['gpt_neox.layers.1.attention.dense.1.inner']" in problems[1]
    assert "do not reach the per-sample loss" in problems[1] and "exclude=(...)" in problems[1]
    with pytest.raises(RuntimeError, match=r"never arrived: \['gpt_neox.layers.1.attention.dense.1.inner'\]"):
        engine.score(lit.per_sample_loss, _rows(), N_CAND, OptimizerStepMaps(torch.optim.SGD(lit.parameters(), lr=0.1)))
    whole = _learner("gpt-neox")
    assert GhostEngine(whole.model).capture_problems(whole.per_sample_loss, _rows()) == []


@pytest.mark.parametrize("method", ["opus", "greats"])
def test_a_wiring_the_capture_cannot_serve_is_refused_before_the_first_step(tiny_corpus, method: str) -> None:
    """The fit-start check runs one capture pass over the target rows: both layers named, with their causes, in the one
    error before the first step; leaving them out with layers=[...] lets the fit run."""
    seen = []

    class Recording(LitCausalLM):
        def training_step(self, batch, batch_idx):
            seen.append(batch_idx)
            return super().training_step(batch, batch_idx)

    def fit(selection) -> None:
        lit = _miswired()
        learner = Recording(lit.config, warmup_steps=1)
        learner.model = lit.model
        trainer = L.Trainer(accelerator="cpu", max_steps=1, callbacks=[selection], logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0)
        data = PoolDataModule(tiny_corpus["pool"], tiny_corpus["target"], tiny_corpus["val"], seq_len=32, batch_size=4,
                              ratio=0.5, seed=0, progress=False)
        trainer.fit(learner, datamodule=data)

    with pytest.raises(ValueError, match=r"(?s)cannot start:.*did not run.*\['gpt_neox.unused'\].*"
                                         r"never arrived: \['gpt_neox.layers.1.attention.dense.1.inner'\]") as info:
        fit(METHODS[method](ratio=0.5, target_batch_size=4))
    assert seen == [] and "torch.compile" not in str(info.value)
    fit(METHODS[method](ratio=0.5, target_batch_size=4, layers=["gpt_neox.layers.0.*", "gpt_neox.layers.1.mlp.*"]))
    assert seen == [0]
