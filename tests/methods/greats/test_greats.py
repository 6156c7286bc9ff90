"""GREATS' step size: η is one row's weight in the real SGD step, over every DDP rank's and micro-batch's rows."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from selection_callbacks.methods import GreatsSelection


@pytest.mark.parametrize(("world", "accumulation"), [(1, 1), (2, 1), (2, 3)])
def test_eta_weighs_each_of_the_w_k_a_rows_of_the_real_step(world: int, accumulation: int) -> None:
    """The SGD step that DDP takes, emulated (each rank's loss is the mean over its K rows divided by A, gradients
    accumulate over A micro-batches, the ranks' gradients are averaged), equals −Σ_i P g_i with GREATS' P = η·I:
    η = lr/(W·K·A), not lr/(K·A) of one rank."""
    torch.manual_seed(0)
    k, lr = 4, 0.3
    layer = torch.nn.Linear(3, 2, bias=False)
    x = torch.randn(accumulation, world, k, 3)
    y = torch.randn(accumulation, world, k, 2)
    opt = torch.optim.SGD(layer.parameters(), lr=lr)
    maps = GreatsSelection().step_maps(
        SimpleNamespace(optimizers=[opt], world_size=world, accumulate_grad_batches=accumulation), k)

    def loss(weight, xi, yi):
        return ((xi @ weight.T - yi) ** 2).sum()

    per_row = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, 0))
    rows = per_row(layer.weight, x.reshape(-1, 3), y.reshape(-1, 2))  # g_i [W·K·A, 2, 3]
    step_map = maps([layer.weight], rows.mean(0))
    predicted = -step_map.apply(rows).sum(0)  # −Σ_i η g_i over the W·K·A rows

    before = layer.weight.detach().clone()
    rank_grads = []
    for r in range(world):
        layer.weight.grad = None
        for a in range(accumulation):
            rank_loss = torch.stack([loss(layer.weight, xi, yi) for xi, yi in zip(x[a, r], y[a, r])]).mean()
            (rank_loss / accumulation).backward()  # Lightning's accumulation: each micro-batch weighs 1/A
        rank_grads.append(layer.weight.grad.clone())
    layer.weight.grad = torch.stack(rank_grads).mean(0)  # DDP's all-reduce: the mean over ranks
    opt.step()
    torch.testing.assert_close(layer.weight.detach() - before, predicted)
