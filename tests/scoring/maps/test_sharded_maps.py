"""The ghost engine and the optimizer maps on an FSDP2-sharded model (one process, a gloo mesh of one) score as on
the same model unsharded, bit for bit.

Two copies of one tiny GPT (with biases) train 3 AdamW (or SGD) steps on the same rows, one of them under
``fully_shard`` (each block, then the root): its parameters and AdamW moments are ``DTensor`` s. Over one rank
FSDP2's all-gather and reduce-scatter copy, so both copies hold the same numbers, and the engine (every linear
layer, the embedding and the head) must score them alike: it resolves each layer to the sharded parameter
the optimizer holds (not the unsharded copy the module holds inside a forward and backward, nor the one FSDP2's
root keeps after a forward without backward, here an evaluation forward), reads its moments whole
(``maps.base.whole``) and scores it alone even when asked to stack same-shaped layers (which would change the
order of the float32 sums: the eager copy scores layer by layer). The two-process runs against DDP are in tests/callbacks/test_stack_fsdp.py.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from selection_callbacks.nn.gpt import GPT, GPTConfig
from selection_callbacks.nn.optim import build_optimizer
from selection_callbacks.scoring.ghost.engine import GhostEngine
from selection_callbacks.scoring.losses import mean_token_losses as row_losses
from selection_callbacks.scoring.maps.base import whole
from selection_callbacks.scoring.maps.step_maps import OptimizerStepMaps, SGDStepMaps

T, N, P = 8, 6, 3


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    """A one-process gloo mesh (FSDP2 on one rank)."""
    store = tmp_path_factory.mktemp("store") / "store"
    torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,))
    torch.distributed.destroy_process_group()


def _trained(optimizer: str, mesh=None) -> tuple[GPT, torch.optim.Optimizer]:
    """A GPT trained 3 steps (sharded over ``mesh`` if given) on seeded rows."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=T, n_layer=2, n_head=2, n_embd=16, bias=True))
    if mesh is not None:
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = (torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9) if optimizer == "sgd"
           else build_optimizer(model, "adamw", 3e-3, 0.1, (0.9, 0.95), 0.02, 0.95, 0.0))
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        ids = torch.randint(0, 64, (8, T + 1), generator=gen)
        opt.zero_grad()
        row_losses(model)({"input_ids": ids[:, :-1], "labels": ids[:, 1:]}).mean().backward()
        opt.step()
    return model, opt


def _score(model: GPT, opt: torch.optim.Optimizer, optimizer: str, group_layers: bool):
    ids = torch.randint(0, 64, (N + P, T + 1), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():  # FSDP2 keeps the root unsharded after this forward
        model(ids[:, :-1])
    engine = GhostEngine(model, include_embedding=True, include_head=True, sketch_dim=512, norms=True,
                         group_layers=group_layers)
    maps = SGDStepMaps(opt, N) if optimizer == "sgd" else OptimizerStepMaps(opt)
    return engine, engine.score(row_losses(model), {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}, N, maps, probe=4)


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_sharded_model_scores_as_unsharded(mesh, optimizer: str) -> None:
    eager, sharded = _trained(optimizer), _trained(optimizer, mesh)
    model, opt = sharded
    assert all(isinstance(p, DTensor) for p in model.parameters())
    if optimizer == "adamw":
        assert all(isinstance(opt.state[p]["exp_avg_sq"], DTensor) for p in model.parameters())
    (_, a), (engine, b) = _score(*eager, optimizer, group_layers=False), _score(*sharded, optimizer, group_layers=True)
    assert all(isinstance(engine.parameter(name), DTensor) for name, _ in engine.layers)
    assert a.layer_utilities.keys() == b.layer_utilities.keys() and len(a.layer_utilities) == 10  # 8 in blocks, embedding, head
    for name in a.layer_utilities:
        torch.testing.assert_close(b.layer_utilities[name], a.layer_utilities[name], rtol=0, atol=0, msg=name)
    for key in ("utilities", "sketches", "sq_norms", "losses"):
        torch.testing.assert_close(getattr(b, key), getattr(a, key), rtol=0, atol=0, msg=key)
    torch.testing.assert_close(b.sketch_error["gram"], a.sketch_error["gram"], rtol=0, atol=0)
    assert a.utilities.std() > 0


def test_whole_passes_plain_tensors_through() -> None:
    t = torch.randn(3, 4)
    assert whole(t) is t
