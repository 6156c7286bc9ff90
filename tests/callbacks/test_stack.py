"""The training stack in one process: every online method under a compiled learner (inductor), activation
checkpointing and bf16-mixed scores what the eager fp32 learner scores, from a trained state; unknown strategies
are refused before the first step; Muon is refused under FSDP2.

A 2-layer, width-32 GPT is trained once per module (``PRETRAIN`` steps of AdamW, or Muon+AdamW for
``opus_muon``, on the toy pool); each fit starts from those weights and optimizer moments and runs a few steps
on superbatches of N = 64 (K = 32) from the same seed, recording every step's scores [N] (``last_scores``), the
ghost methods' raw utilities, and the selection. Two fits' scores are compared at the steps both reached through
the same selections (step 0, the trained state, always): after a differing selection the weights differ. The
FSDP2 runs (two processes) are in tests/callbacks/test_stack_fsdp.py.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from types import SimpleNamespace

import lightning as L
import numpy as np
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
from selection_callbacks.nn.optim import build_optimizer

STEPS, SEQ_LEN, N, K, PRETRAIN = 5, 32, 64, 32, 200
CONFIG = GPTConfig(vocab_size=320, block_size=SEQ_LEN, n_layer=2, n_head=2, n_embd=32)
PROXY = {"proxy_layers": 1, "proxy_width": 32, "proxy_heads": 2, "reference_steps": 3, "reference_batch_size": 4}
METHODS = {
    "random": lambda: RandomSelection(ratio=0.5),
    "high_loss": lambda: HighLossSelection(ratio=0.5),
    "oracle": lambda: OracleDomainSelection(ratio=0.5),
    "rho": lambda: RhoLossSelection(ratio=0.5, **PROXY),
    "rho_windows": lambda: RhoLossSelection(ratio=0.5, score_len=16, **PROXY),
    "classact": lambda: ClassActSelection(ratio=0.5, online="learner", **PROXY),
    "classact_report": lambda: ClassActSelection(ratio=0.5, variant="report", **PROXY),
    "opus": lambda: OPUSSelection(ratio=0.5),
    "opus_muon": lambda: OPUSSelection(ratio=0.5),
    "greats": lambda: GreatsSelection(ratio=0.5),
}
GHOST = ("opus", "opus_muon", "greats")
TIE = 1e-3  # top-K members may differ only among candidates within TIE·std of the K-th score (near ties)


def _optimizer(method: str) -> str:
    return "muon" if method.endswith("_muon") else "adamw"


@dataclass
class Trained:
    """A learner's state after ``PRETRAIN`` steps: weights, and its optimizer's state per parameter name."""

    weights: dict[str, torch.Tensor]
    moments: dict[str, dict[str, torch.Tensor]]


def _inner(optimizer: torch.optim.Optimizer) -> tuple[torch.optim.Optimizer, ...]:
    return tuple(getattr(optimizer, "optimizers", (optimizer,)))


def _pretrain(corpus: dict[str, str], optimizer: str) -> Trained:
    """``PRETRAIN`` steps of the learner's own optimizer on random batches of 16 pool sequences."""
    torch.manual_seed(0)
    learner = LitGPT(CONFIG, optimizer=optimizer)
    hp = learner.hparams
    opt = build_optimizer(learner.model, optimizer, hp.lr, hp.weight_decay, tuple(hp.betas), hp.muon_lr,
                          hp.muon_momentum, hp.muon_weight_decay)
    dm = PoolDataModule(corpus["pool"], corpus["target"], corpus["val"], seq_len=SEQ_LEN, batch_size=K, progress=False)
    dm.setup("fit")
    pool, rng = dm.splits["pool"], np.random.default_rng(0)
    for _ in range(PRETRAIN):
        learner.per_sample_loss(pool.batch(rng.choice(len(pool), 16, replace=False))).mean().backward()
        opt.step()
        opt.zero_grad()
    names = {p: name for name, p in learner.model.named_parameters()}
    moments = {names[p]: {k: v.clone() for k, v in state.items()} for o in _inner(opt) for p, state in o.state.items()}
    return Trained({k: v.clone() for k, v in learner.model.state_dict().items()}, moments)


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """One intra-op thread: at these sizes a second one only waits on a busy machine (tens of times slower)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def trained(tiny_corpus, _one_thread) -> dict[str, Trained]:
    return {optimizer: _pretrain(tiny_corpus, optimizer) for optimizer in ("adamw", "muon")}


class StepScores(L.Callback):
    """Sets the trained optimizer state at the start; then each step's scores [N], the ghost methods' raw
    utilities [N], the kept positions [K] from the selection callback, and Dynamo's graph count."""

    def __init__(self, selector: SelectionCallback, state: Trained) -> None:
        self.selector, self.state = selector, state
        self.scores, self.utilities, self.selected, self.graphs = [], [], [], []
        self.learner: L.LightningModule | None = None

    def on_train_start(self, trainer, pl_module) -> None:
        names = {p: name for name, p in pl_module.model.named_parameters()}
        for opt in _inner(trainer.optimizers[0]):
            for group in opt.param_groups:
                for p in group["params"]:
                    opt.state[p] = {k: v.clone() for k, v in self.state.moments[names[p]].items()}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.scores.append(self.selector.last_scores.clone())
        last = getattr(self.selector, "_last", None)  # a ghost method's GhostScores
        self.utilities.append(None if last is None else last.utilities.clone())
        self.selected.append(sorted(self.selector.last_selected.tolist()))
        self.graphs.append(counters["stats"]["unique_graphs"])
        self.learner = pl_module


def _fit(corpus: dict[str, str], trained: dict[str, Trained], method: str, steps: int = STEPS,
         precision: str = "32-true", **stack: bool) -> StepScores:
    """Fit the trained GPT with ``method`` (and ``compile`` / ``activation_checkpointing`` from ``stack``); its scores."""
    L.seed_everything(0)
    selector, state = METHODS[method](), trained[_optimizer(method)]
    record = StepScores(selector, state)
    trainer = L.Trainer(accelerator="cpu", max_steps=steps, precision=precision, callbacks=[selector, record],
                        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0)
    model = LitGPT(CONFIG, optimizer=_optimizer(method), warmup_steps=1, min_lr_ratio=1.0, **stack)  # LR not in steps
    model.model.load_state_dict(state.weights)
    dm = PoolDataModule(corpus["pool"], corpus["target"], corpus["val"], seq_len=SEQ_LEN, batch_size=K, ratio=K / N,
                        progress=False)
    trainer.fit(model, datamodule=dm)
    assert len(record.scores) == steps and record.scores[0].shape == (N,)
    return record


@pytest.fixture(scope="module")
def eager(tiny_corpus, trained):
    """method → its eager fp32 fit (fitted on first use)."""
    fits: dict[str, StepScores] = {}

    def get(method: str) -> StepScores:
        if method not in fits:
            fits[method] = _fit(tiny_corpus, trained, method)
        return fits[method]

    return get


def _spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(spearmanr(a.numpy(), b.numpy()).statistic)


def _shared_steps(got: StepScores, want: StepScores) -> range:
    """The steps both fits reached through the same selections: step 0 and each step after equal selections."""
    n = 1
    while n < min(len(got.selected), len(want.selected)) and got.selected[n - 1] == want.selected[n - 1]:
        n += 1
    return range(n)


def _assert_ranks_agree(got: StepScores, want: StepScores, method: str, least: float, top_k: bool = False) -> None:
    """At each shared step: constant scores (random) equal, with the same selection; else Spearman ≥ ``least`` and,
    with ``top_k``, the same top-K but for near ties (candidates within TIE·std of want's K-th score)."""
    for step in _shared_steps(got, want):
        a, b = got.scores[step], want.scores[step]
        if b.std() == 0:
            assert torch.equal(a, b) and got.selected[step] == want.selected[step], (method, step)
            continue
        assert _spearman(a, b) >= least, (method, step, _spearman(a, b))
        if top_k:
            kth = b.topk(K).values[-1]
            differ = set(a.topk(K).indices.tolist()) ^ set(b.topk(K).indices.tolist())
            assert all(abs(b[i] - kth) <= TIE * b.std() for i in differ), (method, step, sorted(differ))


@pytest.mark.parametrize("method", METHODS)
def test_compiled_learner_scores_as_eager_without_recompiling(tiny_corpus, trained, eager, method: str) -> None:
    """Inductor-compiled blocks: scores rank as eager's (Spearman ≥ 0.999, the same top-K but for near ties), and after
    4 warm-up steps (superbatch N and kept K shapes, grad and no-grad) 10 more steps add no Dynamo graph (0
    recompiles). The ghost methods score the eager modules (a warning says so) and the training step stays compiled."""
    torch._dynamo.reset()
    counters.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled = _fit(tiny_corpus, trained, method, steps=14, compile=True)
    assert fit_stack(compiled.learner).compiled
    warned = [str(w.message) for w in caught if "scores the learner's eager modules" in str(w.message)]
    assert len(warned) == (method in GHOST), warned
    _assert_ranks_agree(compiled, eager(method), method, 0.999, top_k=True)
    assert compiled.graphs[-1] > 0  # the blocks did compile
    assert compiled.graphs[-1] == compiled.graphs[3], compiled.graphs


@pytest.mark.parametrize("method", METHODS)
def test_activation_checkpointing_scores_equal_eager(tiny_corpus, trained, eager, method: str) -> None:
    """Checkpointed blocks recompute the same operations: every step's scores (and the ghost methods' raw utilities)
    equal to 1e-5 relative, same selections."""
    checkpointed, want = _fit(tiny_corpus, trained, method, activation_checkpointing=True), eager(method)
    assert fit_stack(checkpointed.learner).checkpointed
    for step in range(STEPS):
        torch.testing.assert_close(checkpointed.scores[step], want.scores[step], rtol=1e-5, atol=1e-7,
                                   msg=f"{method} step {step}")
        if method in GHOST:
            u = want.utilities[step]
            torch.testing.assert_close(checkpointed.utilities[step], u, rtol=1e-5, atol=1e-5 * float(u.abs().max()))
    assert checkpointed.selected == want.selected


@pytest.mark.parametrize("method", METHODS)
def test_bf16_mixed_scores_rank_as_fp32(tiny_corpus, trained, eager, method: str) -> None:
    """bf16-mixed autocast (losses, proxies' losses and ghost utilities reduced in fp32): scores Spearman ≥ 0.98 to fp32."""
    _assert_ranks_agree(_fit(tiny_corpus, trained, method, precision="bf16-mixed"), eager(method), method, 0.98)


def test_stack_applies_in_place_and_compiles_checkpointed_blocks() -> None:
    """compile + activation checkpointing: applied once, in place (the eager parameter names), the checkpointed blocks
    compile to a graph (Dynamo's checkpoint operator), and losses and gradients equal the eager model's."""
    torch.manual_seed(0)
    plain = LitGPT(CONFIG)
    torch.manual_seed(0)
    model = LitGPT(CONFIG, compile=True, activation_checkpointing=True)
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
    model = LitGPT(CONFIG, optimizer="muon")
    model._device_mesh = _Mesh({"data_parallel": 2})  # what ModelParallelStrategy hands the module
    with pytest.raises(ValueError, match="Muon does not run under FSDP2: its Newton-Schulz orthogonalisation needs"):
        model.configure_optimizers()


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


def test_sharded_parameters_are_served_by_every_method_and_refused_by_a_default_declaration(tmp_path) -> None:
    """FSDP2 shards (DTensor parameters, here over a one-process gloo mesh) are read as such; every shipped online
    method serves them, and a method that declares the default stack (eager only) is refused, naming FSDP2."""
    for method in (OPUSSelection, GreatsSelection, RhoLossSelection):
        assert method.supported_stack == Stack(compiled=True, sharded=True, checkpointed=True)
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = torch.nn.Sequential(torch.nn.Linear(4, 4))
        fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
        assert fit_stack(model) == Stack(sharded=True)
        [problem] = stack_problems(SimpleNamespace(strategy=None), model, Stack(), "MySelection")
        assert problem.startswith("MySelection does not run under FSDP2 (DTensor parameter shards")
        for method in (OPUSSelection, GreatsSelection, RhoLossSelection):
            assert stack_problems(SimpleNamespace(strategy=None), model, method.supported_stack, method.__name__) == []
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
