"""The surrogate predicts the real effect of one optimizer step on the target loss."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from scipy.stats import spearmanr

from selection_callbacks.data.packing import pack_source
from selection_callbacks.nn.gpt import GPT, GPTConfig
from selection_callbacks.nn.optim import build_optimizer
from selection_callbacks.scoring.ghost.engine import GhostEngine
from selection_callbacks.scoring.maps.step_maps import OptimizerStepMaps

K = 16  # a candidate enters the update as 1/K of the batch mean


def losses(model, batch):
    logits = model(batch["input_ids"])
    nll = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), reduction="none")
    return nll.view(logits.shape[0], -1).mean(1)


def new_optimizer(model, name: str):
    return build_optimizer(model, name, 3e-3, 0.1, (0.9, 0.95), 0.02, 0.95, 0.0)


@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_utility_ranks_real_target_loss_decrease(tiny_corpus, tmp_path, name: str) -> None:
    pool = pack_source(tiny_corpus["pool"], 32, tmp_path, progress=False)
    target = pack_source(tiny_corpus["target"], 32, tmp_path, progress=False)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=320, block_size=32, n_layer=2, n_head=2, n_embd=32))
    opt = new_optimizer(model, name)
    rng = np.random.default_rng(0)
    for _ in range(60):  # train at the training learning rate so the optimizer state is real
        opt.zero_grad()
        losses(model, pool.batch(rng.choice(len(pool), K, replace=False))).mean().backward()
        opt.step()
    cand = pool.batch(rng.choice(len(pool), K, replace=False))
    target_rows = target.batch(rng.choice(len(target), 8, replace=False))
    rows = {k: torch.cat([cand[k], target_rows[k]]) for k in ("input_ids", "labels")}
    engine = GhostEngine(model, include_embedding=True, include_head=True)
    predicted = engine.score(lambda b: losses(model, b), rows, K, OptimizerStepMaps(opt)).utilities
    with torch.no_grad():
        before = losses(model, target_rows).mean()
    actual = []
    for i in range(K):  # one real optimizer step per candidate, from the same state
        m2 = copy.deepcopy(model)
        o2 = new_optimizer(m2, name)
        o2.load_state_dict(copy.deepcopy(opt.state_dict()))
        o2.zero_grad()
        (losses(m2, {k: v[i : i + 1] for k, v in cand.items()}).sum() / K).backward()
        o2.step()
        with torch.no_grad():
            actual.append(float(before - losses(m2, target_rows).mean()))
    rho = spearmanr(predicted.numpy(), np.asarray(actual)).statistic
    assert rho >= 0.8, f"rank correlation {rho:.3f} between predicted utility and real target-loss decrease"
