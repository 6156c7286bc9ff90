"""Windows scored alone and after their prefix (``score_windows(context=True)``), against brute force."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call, grad, vmap

from selection_callbacks.nn.gpt import GPT, GPTConfig
from selection_callbacks.nn.optim import build_optimizer
from selection_callbacks.scoring.ghost.engine import GhostEngine
from selection_callbacks.scoring.losses import sequence_means, token_losses
from selection_callbacks.scoring.maps.step_maps import OptimizerStepMaps
from selection_callbacks.scoring.windows import ignores_loss_mask, score_windows

T, L, V = 24, 6, 64


def model(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=V, block_size=T, n_layer=2, n_head=2, n_embd=16))


def rows(n: int, seed: int = 1) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, V, (n, T + 1), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}


def masked_losses(net: torch.nn.Module):
    """batch → [n] mean token loss over ``loss_mask`` (the learners' and proxies' per-sample loss)."""
    return lambda b: sequence_means(*token_losses(net(b["input_ids"]), b)[:2])


def offsets(seed: int, n: int) -> list[int]:
    return torch.randint(0, T - L + 1, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("labels", [True, False])
def test_a_window_in_context_is_its_tokens_loss_after_the_prefix_alone(labels: bool) -> None:
    """Each row's in-context loss equals a forward of only its prefix and window, the loss on the window's targets
    (those the window scored alone predicts), and a row's own mask still drops its masked tokens."""
    net, batch = model(), rows(5)
    if not labels:
        batch = {"input_ids": batch["input_ids"]}
    batch["loss_mask"] = torch.ones(5, T)
    batch["loss_mask"][0] = 0.0  # row 0 is fully masked by its own mask: no token of it counts
    cut = score_windows(batch, L, torch.Generator().manual_seed(3), context=True)
    alone = score_windows(batch, L, torch.Generator().manual_seed(3))
    assert cut["input_ids"] is batch["input_ids"] and cut["loss_mask"].shape == (5, T)
    with torch.no_grad():
        got = masked_losses(net)(cut)
        for r, o in enumerate(offsets(3, 5)):
            logits = net(batch["input_ids"][r : r + 1, : o + L])[0]
            if labels:
                want, targets = F.cross_entropy(logits[o:], batch["labels"][r, o : o + L]), batch["labels"][r, o : o + L]
                assert torch.equal(targets, alone["labels"][r])
            else:
                want = F.cross_entropy(logits[o : o + L - 1], batch["input_ids"][r, o + 1 : o + L])
                assert torch.equal(batch["input_ids"][r, o : o + L], alone["input_ids"][r])
            if r == 0:
                assert float(got[0]) == 0.0 and cut["loss_mask"][0].sum() == 0
            else:
                torch.testing.assert_close(got[r], want, rtol=1e-5, atol=1e-6)


def test_windows_in_context_keep_the_offsets_of_windows_alone_under_ddp() -> None:
    """The rank's slice of the global draw: rank 1 of 2 marks the windows a single process cuts for rows 4-7."""
    batch = rows(8)
    whole = score_windows(batch, L, torch.Generator().manual_seed(5), context=True)
    rank1 = score_windows({k: v[4:] for k, v in batch.items()}, L, torch.Generator().manual_seed(5), 1, 2, context=True)
    assert torch.equal(rank1["loss_mask"], whole["loss_mask"][4:])
    assert whole["loss_mask"].sum(1).tolist() == [L] * 8


def test_ignores_loss_mask_tells_a_loss_that_drops_the_mask() -> None:
    net, batch = model(), rows(3)
    assert not ignores_loss_mask(masked_losses(net), batch)
    blind = masked_losses(net)
    assert ignores_loss_mask(lambda b: blind({k: v for k, v in b.items() if k != "loss_mask"}), batch)
    dropout = torch.nn.Dropout(0.5)  # a loss with dropout draws the same masks in both calls
    assert ignores_loss_mask(lambda b: dropout(net(b["input_ids"])).mean((1, 2)), batch)


def test_ghost_utilities_in_context_are_per_sample_gradients_of_the_windows_loss() -> None:
    """OPUS's utilities with windows after their prefix: ⟨G_i, −Jᵀḡ⟩ with G_i the gradient of row i's window loss
    through its prefix (torch.func per-sample gradients of the masked loss), AdamW's map after 3 real steps."""
    net = model()
    opt = build_optimizer(net, "adamw", 3e-3, 0.1, (0.9, 0.95), 0.02, 0.95, 0.0)
    for s in range(3):
        opt.zero_grad()
        masked_losses(net)(rows(8, seed=10 + s)).mean().backward()
        opt.step()
    n = 5
    batch = score_windows(rows(n + 3), L, torch.Generator().manual_seed(7), context=True)
    maps = OptimizerStepMaps(opt)
    got = GhostEngine(net).score(masked_losses(net), batch, n, maps)
    params = {k: v.detach() for k, v in net.named_parameters()}

    def single(p, x, y, m):
        nll = F.cross_entropy(functional_call(net, p, (x[None],))[0], y, reduction="none")
        return (nll * m).sum() / m.sum()

    G = vmap(grad(single), in_dims=(None, 0, 0, 0))(params, batch["input_ids"], batch["labels"], batch["loss_mask"])
    want, live = torch.zeros(n), dict(net.named_parameters())
    for name, module in GhostEngine(net).layers:
        full = f"{name}.weight"
        gbar = G[full][n:].mean(0)
        want += (G[full][:n] * maps([live[full]], gbar[None]).utility_vector(gbar[None])[0]).flatten(1).sum(1)
    torch.testing.assert_close(got.utilities, want, rtol=1e-4, atol=1e-6 * float(want.abs().max()))
    assert float(want.abs().min()) > 0


@pytest.mark.parametrize("context", [False, True])
def test_each_rank_cuts_its_candidates_the_windows_of_the_global_rows(context: bool) -> None:
    """Under DDP rank r's N rows get the windows that one process cutting all W·N rows gives them (proxies that train
    on the global rows see the windows each rank scored)."""
    world, n, every = 3, 4, rows(12)
    whole = score_windows(every, L, torch.Generator().manual_seed(5), context=context)
    for rank in range(world):
        mine = {k: v[rank * n : (rank + 1) * n] for k, v in every.items()}
        cut = score_windows(mine, L, torch.Generator().manual_seed(5), rank, world, context=context)
        for key, value in cut.items():
            assert torch.equal(value, whole[key][rank * n : (rank + 1) * n]), key
