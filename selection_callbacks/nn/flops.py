"""Matrix-multiply FLOPs per token of a model: what a cost model weighs a model's token passes by."""

from __future__ import annotations

from collections.abc import Iterable

import torch.nn as nn

from selection_callbacks.nn.optim import conv1d_type


def is_linear(module: nn.Module) -> bool:
    """``nn.Linear`` or transformers' ``Conv1D``: the layers whose matmuls the FLOP counts cover."""
    conv1d = conv1d_type()
    return isinstance(module, nn.Linear) or (conv1d is not None and isinstance(module, conv1d))


def linear_flops_per_token(modules: Iterable[nn.Module]) -> int:
    """2 · Σ d_in·d_out over the linear layers among ``modules`` (a layer listed twice counts twice)."""
    return 2 * sum(m.weight.numel() for m in modules if is_linear(m))


def matmul_flops_per_token(model: nn.Module) -> int:
    """2 · Σ d_in·d_out over the model's linear layers (``nn.Linear``, transformers' ``Conv1D``): one forward's
    multiply-adds per token. Embedding lookups are free; attention's T-dependent score products are left out
    (at T = 128 and width 128 about a sixth of a block's matmuls), so this under-counts long contexts."""
    return linear_flops_per_token(model.modules())
