"""The training stack in one process: each loss-based method under a compiled learner (inductor), activation
checkpointing and bf16-mixed scores what the eager fp32 learner scores; the ghost methods and unknown strategies
are refused before the first step; Muon is refused under FSDP2.

Each fit trains a 2-layer, width-32 GPT for a few steps on superbatches of N = 8 (K = 4) from the same seed, and
records every step's scores [N] (``last_scores``) and selection. The FSDP2 runs (two processes) are in
tests/test_stack_fsdp.py.
"""

from __future__ import annotations

import math
import re
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from lightning.pytorch.strategies import DeepSpeedStrategy, ModelParallelStrategy
from scipy.stats import spearmanr
from torch._dynamo.utils import counters
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from models.lit_gpt import LitGPT
from selection_callbacks.callbacks.base import SelectionCallback
from selection_callbacks.callbacks.stack import Stack, fit_stack, stack_problems
from selection_callbacks.data.datamodule import PoolDataModule
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

STEPS, SEQ_LEN, K = 5, 32, 4
PROXY = {"proxy_layers": 1, "proxy_width": 32, "proxy_heads": 2, "reference_steps": 3, "reference_batch_size": 4}
METHODS = {
    "random": lambda: RandomSelection(ratio=0.5),
    "high_loss": lambda: HighLossSelection(ratio=0.5),
    "oracle": lambda: OracleDomainSelection(ratio=0.5),
    "rho": lambda: RhoLossSelection(ratio=0.5, **PROXY),
    "classact": lambda: ClassActSelection(ratio=0.5, online="learner", **PROXY),
}


class StepScores(L.Callback):
    """Each step's scores [N] and kept positions [K] from the selection callback, and Dynamo's graph count."""

    def __init__(self, selector: SelectionCallback) -> None:
        self.selector, self.scores, self.selected, self.graphs = selector, [], [], []
        self.learner: L.LightningModule | None = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.scores.append(self.selector.last_scores.clone())
        self.selected.append(sorted(self.selector.last_selected.tolist()))
        self.graphs.append(counters["stats"]["unique_graphs"])
        self.learner = pl_module


def _fit(corpus: dict[str, str], method: str, steps: int = STEPS, precision: str = "32-true", **stack: bool) -> StepScores:
    """Fit the tiny GPT with ``method`` (and ``compile`` / ``activation_checkpointing`` from ``stack``); its scores."""
    L.seed_everything(0)
    selector = METHODS[method]()
    record = StepScores(selector)
    trainer = L.Trainer(accelerator="cpu", max_steps=steps, precision=precision, callbacks=[selector, record],
                        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0)
    model = LitGPT(GPTConfig(vocab_size=320, block_size=SEQ_LEN, n_layer=2, n_head=2, n_embd=32), warmup_steps=1, **stack)
    dm = PoolDataModule(corpus["pool"], corpus["target"], corpus["val"], seq_len=SEQ_LEN, batch_size=K, ratio=0.5,
                        progress=False)
    trainer.fit(model, datamodule=dm)
    assert len(record.scores) == steps
    return record


@pytest.fixture(scope="module")
def eager(tiny_corpus) -> dict[str, StepScores]:
    return {m: _fit(tiny_corpus, m) for m in METHODS}


def _spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(spearmanr(a.numpy(), b.numpy()).statistic)


def _assert_ranks_agree(got: StepScores, want: StepScores, method: str, least: float) -> None:
    """Per step: constant scores (random) equal, else Spearman ≥ ``least``; step 0 (same weights) also allclose."""
    torch.testing.assert_close(got.scores[0], want.scores[0], rtol=1e-2, atol=1e-2)
    for step, (a, b) in enumerate(zip(got.scores, want.scores)):
        if b.std() == 0:
            assert torch.equal(a, b), (method, step)
            assert got.selected[step] == want.selected[step], (method, step)
        else:
            assert _spearman(a, b) >= least, (method, step, a, b)


@pytest.mark.parametrize("method", METHODS)
def test_compiled_learner_scores_as_eager_without_recompiling(tiny_corpus, eager, method: str) -> None:
    """Inductor-compiled blocks: every step's scores rank as eager's (Spearman ≥ 0.999), and after 4 warm-up steps
    (superbatch N and kept K shapes, grad and no-grad) 10 more steps add no Dynamo graph (0 recompiles)."""
    torch._dynamo.reset()
    counters.clear()
    compiled = _fit(tiny_corpus, method, steps=14, compile=True)
    assert fit_stack(compiled.learner).compiled
    _assert_ranks_agree(SimpleNamespace(scores=compiled.scores[:STEPS], selected=compiled.selected[:STEPS]),
                        eager[method], method, 0.999)
    assert compiled.graphs[-1] > 0  # the blocks did compile
    assert compiled.graphs[-1] == compiled.graphs[3], compiled.graphs


@pytest.mark.parametrize("method", METHODS)
def test_activation_checkpointing_scores_equal_eager(tiny_corpus, eager, method: str) -> None:
    """Checkpointed blocks recompute the same operations: every step's scores equal to 1e-5 relative, same selections."""
    checkpointed = _fit(tiny_corpus, method, activation_checkpointing=True)
    assert fit_stack(checkpointed.learner).checkpointed
    for step, (a, b) in enumerate(zip(checkpointed.scores, eager[method].scores)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7, msg=f"{method} step {step}")
    assert checkpointed.selected == eager[method].selected


@pytest.mark.parametrize("method", METHODS)
def test_bf16_mixed_scores_rank_as_fp32(tiny_corpus, eager, method: str) -> None:
    """bf16-mixed autocast (losses and proxies' losses reduced in fp32): every step's scores Spearman ≥ 0.98 to fp32."""
    _assert_ranks_agree(_fit(tiny_corpus, method, precision="bf16-mixed"), eager[method], method, 0.98)


def test_stack_applies_in_place_and_compiles_checkpointed_blocks() -> None:
    """compile + activation checkpointing: applied once, in place (the eager parameter names), the checkpointed blocks
    compile to a graph (Dynamo's checkpoint operator), and losses and gradients equal the eager model's."""
    config = GPTConfig(vocab_size=320, block_size=SEQ_LEN, n_layer=2, n_head=2, n_embd=32)
    torch.manual_seed(0)
    plain = LitGPT(config)
    torch.manual_seed(0)
    model = LitGPT(config, compile=True, activation_checkpointing=True)
    assert fit_stack(model) == Stack()  # nothing applied before configure_model
    model.configure_model()
    model.configure_model()  # once per process: a second call (validate after fit) applies nothing twice
    assert fit_stack(model) == Stack(compiled=True, checkpointed=True)
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in plain.named_parameters()]
    torch._dynamo.reset()
    counters.clear()
    batch = {"input_ids": torch.randint(0, 320, (4, SEQ_LEN))}
    losses, want = model.per_sample_loss(batch), plain.per_sample_loss(batch)
    losses.mean().backward()
    want.mean().backward()
    assert counters["stats"]["unique_graphs"] > 0
    torch.testing.assert_close(losses, want, rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_muon_refused_under_fsdp2() -> None:
    model = LitGPT(GPTConfig(vocab_size=320, block_size=SEQ_LEN, n_layer=2, n_head=2, n_embd=32), optimizer="muon")
    model._device_mesh = _Mesh({"data_parallel": 2})  # what ModelParallelStrategy hands the module
    with pytest.raises(ValueError, match="Muon does not run under FSDP2: its Newton-Schulz orthogonalisation needs"):
        model.configure_optimizers()


@pytest.mark.parametrize("stack", [{"compile": True}, {"activation_checkpointing": True}])
@pytest.mark.parametrize("ghost", [OPUSSelection, GreatsSelection])
def test_ghost_methods_refuse_compile_and_checkpointing(tiny_corpus, ghost, stack: dict[str, bool]) -> None:
    trainer = L.Trainer(accelerator="cpu", max_steps=1, callbacks=[ghost(ratio=0.5)], logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    model = LitGPT(GPTConfig(vocab_size=320, block_size=SEQ_LEN, n_layer=2, n_head=2, n_embd=32), **stack)
    dm = PoolDataModule(tiny_corpus["pool"], tiny_corpus["target"], tiny_corpus["val"], seq_len=SEQ_LEN, batch_size=K,
                        ratio=0.5, progress=False)
    what = "a compiled learner (torch.compile)" if "compile" in stack else "activation checkpointing"
    with pytest.raises(ValueError, match=re.escape(f"{ghost.__name__} does not run under {what}; it serves the eager")):
        trainer.fit(model, datamodule=dm)


def test_unknown_strategies_refused_for_every_method() -> None:
    """DeepSpeed and tensor parallelism refuse every method, whatever it declares."""
    model = torch.nn.Linear(4, 4)
    deepspeed = SimpleNamespace(strategy=DeepSpeedStrategy.__new__(DeepSpeedStrategy))
    tensor_parallel = ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=2)
    tensor_parallel._device_mesh = _Mesh({"data_parallel": 1, "tensor_parallel": 2})
    for supported in (OPUSSelection.supported_stack, RandomSelection.supported_stack):
        [problem] = stack_problems(deepspeed, model, supported, "M")
        assert problem.startswith("M does not run under DeepSpeedStrategy: online selection runs on one device")
        [problem] = stack_problems(SimpleNamespace(strategy=tensor_parallel), model, supported, "M")
        assert problem.startswith("M does not run under ModelParallelStrategy") and "tensor parallelism" in problem


def test_sharded_parameters_refuse_the_ghost_methods(tmp_path) -> None:
    """FSDP2 shards (DTensor parameters, here over a one-process gloo mesh) refuse OPUS and GREATS, not RHO-LOSS."""
    assert OPUSSelection.supported_stack == GreatsSelection.supported_stack == Stack()
    assert RhoLossSelection.supported_stack == Stack(compiled=True, sharded=True, checkpointed=True)
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = torch.nn.Sequential(torch.nn.Linear(4, 4))
        fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
        assert fit_stack(model) == Stack(sharded=True)
        for ghost in (OPUSSelection, GreatsSelection):
            [problem] = stack_problems(SimpleNamespace(strategy=None), model, ghost.supported_stack, ghost.__name__)
            assert problem.startswith(f"{ghost.__name__} does not run under FSDP2 (DTensor parameter shards")
        assert stack_problems(SimpleNamespace(strategy=None), model, RhoLossSelection.supported_stack, "R") == []
    finally:
        torch.distributed.destroy_process_group()


class _Mesh:
    """A stand-in device mesh: named dimension sizes."""

    def __init__(self, sizes: dict[str, int]) -> None:
        self.mesh_dim_names, self.sizes = tuple(sizes), sizes

    def __getitem__(self, name: str) -> SimpleNamespace:
        return SimpleNamespace(size=lambda: self.sizes[name])

    def size(self) -> int:
        return math.prod(self.sizes.values())
