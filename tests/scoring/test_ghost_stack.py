"""The ghost engine under the training stack, on a tiny GPT: compiled modules scored through their eager forward
(:func:`~selection_callbacks.scoring.ghost.eager.eager`), and activation checkpointing's recomputation ignored by
the capture. The fits (OPUS and GREATS under a compiled, checkpointed or bf16-mixed learner) are in
tests/callbacks/test_stack.py."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.utilities.compile import from_compiled
from torch._dynamo.eval_frame import OptimizedModule

from models.lit_gpt import LitGPT
from selection_callbacks.nn.checkpointing import checkpoint_activations
from selection_callbacks.nn.gpt import GPT, GPTConfig
from selection_callbacks.nn.optim import build_optimizer
from selection_callbacks.scoring.ghost.eager import compiled_modules, eager
from selection_callbacks.scoring.ghost.engine import GhostEngine
from selection_callbacks.scoring.losses import mean_token_losses
from selection_callbacks.scoring.maps.step_maps import OptimizerStepMaps

N, P, T = 6, 3, 8
CONFIG = GPTConfig(vocab_size=64, block_size=T, n_layer=2, n_head=2, n_embd=16)


def _trained(optimizer: str) -> tuple[GPT, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = GPT(CONFIG)
    opt = build_optimizer(model, optimizer, 3e-3, 0.1, (0.9, 0.95), 0.02, 0.95, 0.0)
    for _ in range(3):
        ids = torch.randint(0, 64, (8, T + 1))
        mean_token_losses(model)({"input_ids": ids[:, :-1], "labels": ids[:, 1:]}).mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _rows() -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 64, (N + P, T + 1), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}


def test_eager_swaps_every_compiled_form_and_restores_it() -> None:
    """``Module.compile()``, an ``OptimizedModule`` and Lightning's compiled module each run eager inside the context
    (every layer's forward hook fires, once) and get their compiled forward back, the same objects, on exit."""
    model, _ = _trained("adamw")
    model.blocks[0].compile(backend="eager")
    model.blocks[1] = torch.compile(model.blocks[1], backend="eager")
    assert isinstance(model.blocks[1], OptimizedModule)
    compiled_call, compiled_forward = vars(model.blocks[0])["_compiled_call_impl"], vars(model.blocks[1])["forward"]
    assert compiled_modules(model) == ["blocks.0", "blocks.1"]
    fired = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            module.register_forward_hook(lambda m, args, out, name=name: fired.append(name))
    linears = sorted(n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear))
    with eager(model) as names:
        assert names == ["blocks.0", "blocks.1"]
        model(_rows()["input_ids"])
    assert sorted(fired) == linears  # each layer once, as in the eager module
    assert vars(model.blocks[0])["_compiled_call_impl"] is compiled_call
    assert vars(model.blocks[1])["forward"] is compiled_forward

    learner = from_compiled(torch.compile(LitGPT(CONFIG), backend="eager"))  # what trainer.fit(torch.compile(m)) does
    assert compiled_modules(learner) == [""]
    compiled_forward = learner.forward
    with eager(learner):
        assert learner.forward == learner._compiler_ctx["original_forward"]
    assert learner.forward is compiled_forward


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_compiled_model_scored_through_eager_equals_the_eager_model(optimizer: str) -> None:
    """Inductor-compiled blocks: the engine scores ``eager(model)`` exactly as the never-compiled model (utilities and
    sketches equal), and the compiled blocks still run their compiled code after (no new graph for the same input)."""
    model, opt = _trained(optimizer)
    want = GhostEngine(model, sketch_dim=64).score(mean_token_losses(model), _rows(), N, OptimizerStepMaps(opt))
    torch._dynamo.reset()
    for block in model.blocks:
        block.compile(backend="inductor")
    ids = _rows()["input_ids"]
    with torch.no_grad():
        model(ids)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]

    def loss(rows):
        with eager(model):
            return mean_token_losses(model)(rows)

    got = GhostEngine(model, sketch_dim=64).score(loss, _rows(), N, OptimizerStepMaps(opt))
    torch.testing.assert_close(got.utilities, want.utilities, rtol=0, atol=0)
    torch.testing.assert_close(got.sketches, want.sketches, rtol=0, atol=0)
    with torch.no_grad():
        model(ids)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs  # the hooks left no guard failing


@pytest.mark.parametrize("candidate_chunk", [None, 2])
def test_checkpointed_blocks_score_as_plain_and_still_recompute(candidate_chunk: int | None) -> None:
    """Non-reentrant checkpointing re-runs each block's forward in the scoring backward: the capture ignores those
    calls (no "ran twice"), utilities and sketches equal the plain model's to 1e-5 relative, and the recomputation did
    run (the blocks' activations were not kept)."""
    model, opt = _trained("adamw")
    engine, maps = GhostEngine(model, sketch_dim=64, candidate_chunk=candidate_chunk), OptimizerStepMaps(opt)
    want = engine.score(mean_token_losses(model), _rows(), N, maps)
    checkpoint_activations(model.blocks)
    calls = []
    model.blocks[0].mlp.register_forward_pre_hook(lambda *args: calls.append(1))  # the recomputation stops inside mlp
    got = engine.score(mean_token_losses(model), _rows(), N, maps)
    passes = 1 if candidate_chunk is None else N // candidate_chunk
    assert len(calls) == 2 * passes  # each pass: the forward, then the backward's recomputation
    scale = float(want.utilities.abs().max())
    torch.testing.assert_close(got.utilities, want.utilities, rtol=1e-5, atol=1e-5 * scale)
    torch.testing.assert_close(got.sketches, want.sketches, rtol=1e-5, atol=1e-5 * float(want.sketches.abs().max()))
