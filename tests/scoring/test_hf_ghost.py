"""The ghost engine on Hugging Face causal LMs (Llama, GPT-2's Conv1D, Qwen2's biases; tied and untied heads)
against per-sample gradients from torch.func under SGD, AdamW and Muon+AdamW; OPUS and GREATS through train.py
on each model; the error for a layer type the engine cannot score."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # configs only: nothing is downloaded

import selection_callbacks.scoring.ghost.engine as ghost  # noqa: E402
import train  # noqa: E402
from models import LitCausalLM  # noqa: E402
from models.hf_causal_lm import causal_lm_config  # noqa: E402
from selection_callbacks.methods import GreatsSelection, OPUSSelection  # noqa: E402
from selection_callbacks.methods.bases.ghost import GhostSelection, excluded_layers  # noqa: E402
from selection_callbacks.nn.optim import build_optimizer  # noqa: E402
from selection_callbacks.scoring.ghost.engine import GhostEngine  # noqa: E402
from selection_callbacks.scoring.ghost.layers import scored_layers, tied_weights, unscorable_layers  # noqa: E402
from selection_callbacks.scoring.maps.step_maps import OptimizerStepMaps  # noqa: E402
from selection_callbacks.scoring.sketch import CountSketch, TensorSketch, sketch_blocks  # noqa: E402
from tests.support.per_sample_gradients import assert_utilities_match, brute_force, per_sample_grads  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
N_CAND, N_TARGET, T = 5, 3, 8
# (config, tie_word_embeddings): each model as its config ships and with the other choice of head
MODELS = [("llama", True), ("llama", False), ("gpt2", True), ("gpt2", False), ("qwen2", False), ("qwen2", True)]


@pytest.fixture(params=["grouped", "per_layer"])
def grouping(request, monkeypatch) -> str:
    """An engine test that asks for it runs with same-shaped layers grouped (the accelerator default) and one by one
    (CPU's)."""
    monkeypatch.setattr(ghost, "group_by_default", lambda device, resolve, param: request.param == "grouped")
    return request.param


def _model(name: str, tied: bool) -> LitCausalLM:
    torch.manual_seed(0)
    config = causal_lm_config(str(ROOT / f"configs/model/tiny-{name}.yaml"))
    config.tie_word_embeddings = tied
    return LitCausalLM(config)


def _rows(n: int = N_CAND + N_TARGET, seed: int = 1) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 256, (n, T + 1), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}


def _trained(name: str, tied: bool, optimizer: str, steps: int = 2) -> tuple[LitCausalLM, torch.optim.Optimizer]:
    """The model after ``steps`` steps of ``optimizer`` ("sgd" with momentum, "adamw", or "muon": Muon+AdamW by the split rule)."""
    lit = _model(name, tied)
    if optimizer == "sgd":
        opt = torch.optim.SGD(lit.parameters(), lr=0.05, momentum=0.9)
    else:
        opt = build_optimizer(lit.model, optimizer, 3e-3, 0.1, (0.9, 0.95), 0.02, 0.95, 0.01)
    for step in range(steps):
        opt.zero_grad()
        lit.per_sample_loss(_rows(8, seed=100 + step)).mean().backward()
        opt.step()
    return lit, opt


@pytest.mark.parametrize("optimizer", ["sgd", "adamw", "muon"])
@pytest.mark.parametrize("name, tied", MODELS)
def test_utilities_and_norms_match_per_sample_gradients(grouping: str, name: str, tied: bool, optimizer: str) -> None:
    """Every scored layer type (Linear without bias, Linear with bias, Conv1D with bias, the token embedding, the
    head, tied or not) per layer, under the live optimizer's maps: Muon on hidden matrices (a Conv1D's in its
    stored [in, out] orientation, at its group's rescaled lr), AdamW on the embedding, head and biases."""
    lit, opt = _trained(name, tied, optimizer)
    batch, resolver = _rows(), OptimizerStepMaps(opt)
    engine = GhostEngine(lit.model, include_embedding=True, include_head=True, norms=True)
    got = engine.score(lit.per_sample_loss, batch, N_CAND, resolver)
    layers = [(n, m) for n, m in engine.layers if n not in got.shared]
    want, sq = brute_force(lit.model, per_sample_grads(lit.model, batch), resolver, layers, N_CAND)
    assert got.shared == (["transformer.wpe"] if name == "gpt2" else [])  # a position table, broadcast over rows
    assert list(got.layer_utilities) == list(want)  # a tied weight once, under the embedding
    kinds = {type(m).__name__ for _, m in layers}
    assert kinds == ({"Conv1D", "Embedding", "Linear"} if name == "gpt2" else {"Embedding", "Linear"})
    assert_utilities_match(got, want)
    torch.testing.assert_close(got.sq_norms, sq, rtol=1e-4, atol=0)


@pytest.mark.parametrize("optimizer, sketch", [("sgd", "tensor"), ("muon", "tensor"), ("adamw", "count")])
@pytest.mark.parametrize("name, tied", [("llama", True), ("gpt2", True), ("qwen2", False)])
def test_sketch_is_each_weights_count_sketch(grouping: str, name: str, tied: bool, optimizer: str, sketch: str) -> None:
    """Where the sketch is exact, it is Σ over scored weights of the CountSketch of P G_i under the weight's own hash
    (a tied weight: one hash, the sum of both uses), biases under their own CountSketch. The tensor sketch puts each
    weight in its own block of bins and is exact for SGD and for Muon+AdamW's hidden matrices and biases (a Linear's
    AdamW map is sketched through its rank-1 factorisation, so the embedding and head are left out there); the count
    sketch forms P G_i and is exact for every map (AdamW on the tied weight here)."""
    lit, opt = _trained(name, tied, optimizer)
    batch, resolver = _rows(), OptimizerStepMaps(opt)
    outer = optimizer != "muon"
    engine = GhostEngine(lit.model, include_embedding=outer, include_head=outer, sketch_dim=256, sketch=sketch)
    got = engine.score(lit.per_sample_loss, batch, N_CAND, resolver, seed=3)
    G, names = per_sample_grads(lit.model, batch), {id(p): n for n, p in lit.model.named_parameters()}
    aliases = {n for tied in tied_weights(engine.layers) for n in tied[1:]}  # a tied weight's later uses
    owners = [(i, n, m) for i, (n, m) in enumerate(engine.layers) if n not in aliases]
    blocks = dict(zip([n for _, n, _ in owners], sketch_blocks([m.weight.numel() for _, _, m in owners], 256)))
    cpu, want = torch.device("cpu"), torch.zeros(N_CAND, 256)
    for index, layer, module in (o for o in owners if o[1] not in got.shared):  # a position table holds its bins, unfilled
        g = G[names[id(module.weight)]]
        PG = resolver([module.weight], g[N_CAND:].mean(0)[None]).apply(g[None, :N_CAND])[0]
        if sketch == "count":
            want += CountSketch(256, *PG.shape[1:], 3, [index], cpu)(PG[None])
        else:
            offset, n = blocks[layer]
            bins, signs = TensorSketch(256, *PG.shape[1:], 3, [index], cpu, n, [offset]).explicit()
            want.index_add_(1, bins[0], PG.flatten(1) * signs[0])
        if getattr(module, "bias", None) is not None:
            gb = G[names[id(module.bias)]]
            Pb = resolver([module.bias], gb[N_CAND:].mean(0)[None]).apply(gb[None, :N_CAND])
            want += CountSketch(256, gb.shape[-1], 1, 3, [len(engine.layers) + index], cpu)(Pb[..., None])
    tol = 1e-3 if optimizer == "muon" else 1e-4
    torch.testing.assert_close(got.sketches, want, rtol=tol, atol=tol * float(want.abs().max()))


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_a_tied_weight_is_one_parameter(name: str) -> None:
    """Asking for the head of a tied model scores the embedding's use too; excluding one use alone is refused;
    the pairs are listed once; layers=[...] keeps both uses when a pattern names one."""
    model = _model(name, True).model
    embedding = "model.embed_tokens" if name == "llama" else "transformer.wte"
    names = [n for n, _ in scored_layers(model, include_head=True)]
    assert embedding in names and "lm_head" in names
    assert tied_weights(scored_layers(model, include_head=True)) == [(embedding, "lm_head")]
    assert "lm_head" not in [n for n, _ in scored_layers(model)]  # neither asked for: neither scored
    with pytest.raises(ValueError, match=r"share one weight \(tied\): exclude all of them or none"):
        scored_layers(model, include_embedding=True, include_head=True, exclude=("lm_head",))
    assert embedding not in excluded_layers(model, False, True, ["lm_head"])
    untied = _model(name, False).model
    assert [n for n, _ in scored_layers(untied, include_head=True)][-1] == "lm_head"
    assert embedding not in [n for n, _ in scored_layers(untied, include_head=True)]


class _Factored(torch.nn.Module):
    """A low-rank projection x ↦ x U V: 2-D weights the engine has no ghost form for."""

    def __init__(self, width: int, rank: int = 4) -> None:
        super().__init__()
        self.u = torch.nn.Parameter(torch.randn(width, rank) / width**0.5)
        self.v = torch.nn.Parameter(torch.randn(rank, width) / rank**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.u @ self.v


def test_an_unsupported_layer_is_named_with_the_option_that_skips_it() -> None:
    lit = _model("llama", True)
    lit.model.model.layers[0].self_attn.o_proj = _Factored(64)
    with pytest.raises(TypeError, match=r"layer 'model.layers.0.self_attn.o_proj' \(_Factored.*'u': \(64, 4\).*"
                                        r"layers=\[\.\.\.\].*exclude=\(\.\.\.\)"):
        GhostEngine(lit.model)
    with pytest.raises(TypeError, match="_Factored"):  # a pattern that keeps it still needs it scorable
        GhostEngine(lit.model, exclude=excluded_layers(lit.model, False, False, ["model.layers.0.*"]))
    trainer = SimpleNamespace(precision_plugin=None)  # what OPUS's setup reads of the trainer here
    with pytest.raises(TypeError, match=r"'model.layers.0.self_attn.o_proj' \(_Factored.*layers=\[\.\.\.\]"):
        OPUSSelection().setup(trainer, lit, "fit")
    selection = GreatsSelection(layers=["model.layers.1.*"])
    selection.setup(trainer, lit, "fit")
    assert "model.layers.0.self_attn.o_proj" not in [n for n, _ in selection.engine.layers]
    exclude = excluded_layers(lit.model, False, False, ["model.layers.1.*"])
    assert "model.layers.0.self_attn.o_proj" in exclude
    engine = GhostEngine(lit.model, exclude=exclude)
    assert {n.split(".")[2] for n, _ in engine.layers} == {"1"}
    got = engine.score(lit.per_sample_loss, _rows(), N_CAND, OptimizerStepMaps(torch.optim.SGD(lit.parameters(), lr=0.1)))
    assert got.utilities.shape == (N_CAND,) and torch.isfinite(got.utilities).all()
    for name in ("llama", "gpt2", "qwen2"):  # norms (1-D gains), rotary tables (no parameters): nothing unscorable
        model = _model(name, True).model
        kinds = {type(m).__name__ for m in model.modules()}
        assert any("Norm" in k for k in kinds) and unscorable_layers(model) == []


def test_candidate_chunks_keep_the_position_table_shared(grouping: str) -> None:
    """Passes of one candidate each see GPT-2's position ids [1, T] as one row: still a shared table; the tied weight's
    map, fixed in the first pass, carries over; the scores are one pass's."""
    lit, opt = _trained("gpt2", True, "adamw")
    batch, resolver = _rows(), OptimizerStepMaps(opt)
    whole = GhostEngine(lit.model, include_embedding=True, include_head=True).score(lit.per_sample_loss, batch, N_CAND, resolver)
    chunked = GhostEngine(lit.model, include_embedding=True, include_head=True, candidate_chunk=1).score(
        lit.per_sample_loss, batch, N_CAND, resolver)
    assert chunked.shared == whole.shared == ["transformer.wpe"]
    torch.testing.assert_close(chunked.utilities, whole.utilities, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("head", [False, True])
@pytest.mark.parametrize("model", ["llama", "gpt2", "qwen2"])
@pytest.mark.parametrize("method, optimizer", [("opus", "adamw"), ("opus", "muon"), ("greats", "adamw"), ("greats", "muon")])
def test_online_methods_train_through_train_py(tiny_corpus, tmp_path: Path, model: str, method: str, optimizer: str,
                                               head: bool) -> None:
    """Three steps of OPUS and GREATS scoring the hidden layers (the method configs' default), and with the head
    (with a tied head: the tied weight, both uses)."""
    args = ["fit", "--config", str(ROOT / "configs/scale/cpu-tiny.yaml"), "--config",
            str(ROOT / f"configs/method/{method}.yaml"), "--model", "models.LitCausalLM",
            "--model.config", str(ROOT / f"configs/model/tiny-{model}.yaml"), "--model.optimizer", optimizer,
            "--model.warmup_steps", "1", "--data.pool", tiny_corpus["pool"], "--data.target", tiny_corpus["target"],
            "--data.val", tiny_corpus["val"], "--data.seq_len", "32", "--data.batch_size", "4", "--data.val_samples", "8",
            "--data.progress", "false", "--trainer.max_steps", "3", "--trainer.val_check_interval", "3",
            "--trainer.enable_progress_bar", "false", "--trainer.logger", "false", "--ledger.enabled", "false",
            "--trainer.default_root_dir", str(tmp_path), "--selection.init_args.include_head", str(head).lower()]
    cli = train.main(args)
    selection = next(cb for cb in cli.trainer.callbacks if isinstance(cb, GhostSelection))
    scored = list(selection._last.layer_utilities)
    embedding = {"llama": "model.embed_tokens", "gpt2": "transformer.wte", "qwen2": None}[model]  # the configs' tied heads
    assert ("lm_head" in scored) == (head and embedding is None) and (embedding in scored) == (head and embedding is not None)
    assert any(".mlp." in n for n in scored) and all(torch.isfinite(u).all() for u in selection._last.layer_utilities.values())
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["global_step"] == 3 and metrics["selection"]["kept"] == 3 * 4
    assert metrics["selection"]["candidates_seen"] == 3 * 8 and 0 < metrics["val_bpb"] < 20


def test_muon_utility_of_a_conv1d_is_the_transposed_linears() -> None:
    """GPT-2's Conv1D under Muon, in its stored [in, out] orientation at its group's lr × √(out/in), has the utility
    vector of the same layer as an nn.Linear [out, in] under torch's Muon at the base lr, transposed."""
    lit, opt = _trained("gpt2", True, "muon")
    conv = lit.model.transformer.h[0].mlp.c_fc  # weight [64, 256]
    linear = torch.nn.Parameter(conv.weight.detach().T.clone())
    reference = torch.optim.Muon([linear], lr=0.02, momentum=0.95, weight_decay=0.01)
    reference.state[linear]["momentum_buffer"] = opt.muon.state[conv.weight]["momentum_buffer"].T.clone()
    gbar = torch.randn(1, 64, 256, generator=torch.Generator().manual_seed(0))
    got = OptimizerStepMaps(opt)([conv.weight], gbar).utility_vector(gbar)
    want = OptimizerStepMaps(reference)([linear], gbar.mT).utility_vector(gbar.mT)
    torch.testing.assert_close(got, want.mT, rtol=1e-4, atol=1e-6 * float(want.abs().max()))
