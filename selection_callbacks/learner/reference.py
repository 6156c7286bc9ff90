"""A ``train.py`` checkpoint as a frozen reference model (RHO-LOSS, ClassAct, precomputed reference losses)."""

from __future__ import annotations

import pickle
from pathlib import Path

import torch.nn as nn

from selection_callbacks.learner.lit_gpt import LitGPT

__all__ = ["load_reference"]


def load_reference(path: str | Path) -> nn.Module:
    """The frozen :class:`LitGPT` of a ``train.py`` checkpoint (on CPU, eval mode, no gradients)."""
    if not Path(path).is_file():
        raise FileNotFoundError(
            f"reference checkpoint {str(path)!r} does not exist; train one on the target split "
            "(the README's RHO-LOSS section has the command)"
        )
    try:
        module = LitGPT.load_from_checkpoint(path, map_location="cpu")
    except (KeyError, TypeError, RuntimeError, pickle.UnpicklingError) as err:
        raise ValueError(f"{str(path)!r} is not a LitGPT checkpoint written by train.py: {err}") from err
    return module.eval().requires_grad_(False)
