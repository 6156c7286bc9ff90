"""bench.harness.cost_model.projected_cost: a run's modelled parts carried to another shape, against hand sums."""

from __future__ import annotations

import pytest

from bench.harness.cost_model import Shape, flops_per_token, projected_cost
from selection_callbacks.nn.gpt import GPTConfig

TINY = GPTConfig(vocab_size=320, block_size=128, n_layer=4, n_head=4, n_embd=128)
WIDE = GPTConfig(vocab_size=320, block_size=512, n_layer=4, n_head=4, n_embd=256)
PROXY = GPTConfig(vocab_size=320, block_size=128, n_layer=2, n_head=4, n_embd=128)


def _linear(c: GPTConfig) -> int:
    """2 · Σ d_in·d_out by hand: per block qkv (3d²), proj (d²), MLP (8d²); the head d·vocab."""
    return 2 * (c.n_layer * 12 * c.n_embd ** 2 + c.n_embd * c.vocab_size)


def test_flops_per_token_by_hand() -> None:
    assert flops_per_token(TINY, 128, False) == _linear(TINY)
    assert flops_per_token(WIDE, 512, True) == _linear(WIDE) + 2 * 4 * 512 * 256


def test_same_shape_without_attention_is_the_identity() -> None:
    shape = Shape(TINY, 128, PROXY)
    parts = {"learner_fwd": 0.08, "reference_fwd": 0.04, "learner_reached_bwd": 0.2}
    same = projected_cost(parts, 16, shape, shape, attention=False)
    assert same["parts"] == pytest.approx(parts) and same["ratio"] == pytest.approx(1.32)


def test_projection_by_hand() -> None:
    """T 128 → 512 and width 128 → 256; the proxy keeps 2 × 128 with the longer context."""
    source = Shape(TINY, 128, PROXY)
    target = Shape(WIDE, 512, GPTConfig(vocab_size=320, block_size=512, n_layer=2, n_head=4, n_embd=128))
    matmul = projected_cost({"learner_fwd": 0.25, "reference_fwd": 0.1}, 16, source, target, attention=False)
    # a 16-token window: a quarter of the tokens per update token; the proxy part also shrinks by F_L/F_L'
    assert matmul["parts"] == pytest.approx({"learner_fwd": 0.25 / 4,
                                             "reference_fwd": 0.1 / 4 * _linear(TINY) / _linear(WIDE)})
    whole = projected_cost({"online_fwd": 0.5}, None, source, target)
    learner = _linear(WIDE) + 2 * 4 * 512 * 256  # the training step's tokens see 512 keys' causal half
    proxy = _linear(PROXY) + 2 * 2 * 512 * 128
    assert whole["ratio"] == pytest.approx(1 + 0.5 * proxy / _linear(PROXY) * _linear(TINY) / learner)
    windowed = projected_cost({"learner_fwd": 0.25}, 16, source, target)
    assert windowed["ratio"] == pytest.approx(1 + 0.25 / 4 * (_linear(WIDE) + 2 * 4 * 16 * 256) / learner)
    with pytest.raises(ValueError, match="runs a proxy"):
        projected_cost({"reference_fwd": 0.1}, None, Shape(TINY, 128), Shape(WIDE, 512))
