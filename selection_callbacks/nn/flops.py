"""Matrix-multiply FLOPs per token of a model: what a cost model weighs a model's token passes by."""

from __future__ import annotations

import torch.nn as nn

from selection_callbacks.nn.optim import conv1d_type


def matmul_flops_per_token(model: nn.Module) -> int:
    """2 · Σ d_in·d_out over the model's linear layers (``nn.Linear``, transformers' ``Conv1D``): one forward's
    multiply-adds per token. Embedding lookups are free; attention's T-dependent score products are left out
    (at T = 128 and width 128 about a sixth of a block's matmuls), so this under-counts long contexts."""
    conv1d = conv1d_type()
    kinds = (nn.Linear,) if conv1d is None else (nn.Linear, conv1d)
    return 2 * sum(m.weight.numel() for m in model.modules() if isinstance(m, kinds))
