"""Muon + AdamW as one optimizer: equivalence, scheduler reach, state round trip."""

from __future__ import annotations

import copy

import torch

from selection_callbacks.nn.gpt import GPT, GPTConfig
from selection_callbacks.nn.optim import MuonWithAdamW, build_optimizer, split_params, warmup_cosine

CFG = GPTConfig(vocab_size=64, block_size=8, n_layer=2, n_head=2, n_embd=16)


def _loss(model: GPT, seed: int) -> torch.Tensor:
    ids = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(seed))
    return model(ids).logsumexp(-1).mean() - model(ids).gather(-1, ids[..., None]).mean()


def _opt(model: GPT) -> MuonWithAdamW:
    return build_optimizer(model, "muon", 3e-3, 0.1, (0.9, 0.95), 0.02, 0.95, 0.0)


def test_parameter_split() -> None:
    model = GPT(CFG)
    hidden, other2d, flat = split_params(model)
    assert {id(p) for p in other2d} == {id(model.wte.weight), id(model.wpe.weight), id(model.lm_head.weight)}
    assert all(p.ndim == 2 for p in hidden) and all(p.ndim == 1 for p in flat)
    assert len(hidden) == 4 * CFG.n_layer
    assert sum(p.numel() for p in hidden + other2d + flat) == model.num_params()


def test_composite_equals_separate_optimizers() -> None:
    torch.manual_seed(0)
    a = GPT(CFG)
    b = copy.deepcopy(a)
    opt = _opt(a)
    hidden, other2d, flat = split_params(b)
    muon = torch.optim.Muon(hidden, lr=0.02, momentum=0.95, weight_decay=0.0)
    adamw = torch.optim.AdamW(
        [{"params": other2d, "weight_decay": 0.1}, {"params": flat, "weight_decay": 0.0}], lr=3e-3, betas=(0.9, 0.95)
    )
    for step in range(3):
        for model, opts in ((a, [opt]), (b, [muon, adamw])):
            for o in opts:
                o.zero_grad()
            _loss(model, step).backward()
            for o in opts:
                o.step()
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pa, pb)


def test_scheduler_reaches_inner_groups_also_after_load() -> None:
    model = GPT(CFG)
    opt = _opt(model)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(2, 10, 0.1))
    _loss(model, 0).backward()
    opt.step()
    sched.step()
    assert opt.muon.param_groups[0]["lr"] == 0.02 * 1.0 and opt.adamw.param_groups[0]["lr"] == 3e-3
    opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    for _ in range(5):
        opt.step()
        sched.step()
    expected = warmup_cosine(2, 10, 0.1)(6)
    assert abs(opt.muon.param_groups[0]["lr"] - 0.02 * expected) < 1e-12
    assert abs(opt.adamw.param_groups[1]["lr"] - 3e-3 * expected) < 1e-12


def test_state_dict_round_trip_resumes_identically() -> None:
    torch.manual_seed(0)
    a = GPT(CFG)
    opt_a = _opt(a)
    for step in range(2):
        opt_a.zero_grad()
        _loss(a, step).backward()
        opt_a.step()
    b = copy.deepcopy(a)
    opt_b = _opt(b)
    opt_b.load_state_dict(copy.deepcopy(opt_a.state_dict()))
    assert set(opt_b.state_dict()) == {"muon", "adamw"}
    assert len(opt_b.state) == len(opt_a.state) == sum(1 for _ in a.parameters())
    for model, opt in ((a, opt_a), (b, opt_b)):
        opt.zero_grad()
        _loss(model, 9).backward()
        opt.step()
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pa, pb)


def test_optimizer_for_resolves_each_parameter() -> None:
    model = GPT(CFG)
    opt = _opt(model)
    assert opt.optimizer_for(model.blocks[0].mlp.fc.weight) is opt.muon
    assert opt.optimizer_for(model.wte.weight) is opt.adamw
    assert opt.optimizer_for(model.ln_f.weight) is opt.adamw


def test_warmup_cosine_shape() -> None:
    f = warmup_cosine(10, 110, 0.1)
    assert f(0) == 0.1 and f(9) == 1.0 and abs(f(60) - 0.55) < 1e-9 and abs(f(110) - 0.1) < 1e-12
