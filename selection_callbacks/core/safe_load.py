"""Load a file a user hands over (a checkpoint, a tensor table) without running code from it.

:func:`load_user_file` is ``torch.load(path, map_location="cpu", weights_only=True)``: the
restricted unpickler builds tensors, numbers, strings and plain containers (and the classes the
caller allows with ``safe_globals``), never arbitrary objects, so a crafted pickle cannot execute
code. ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD`` (which turns torch's default back to the full pickle
loader) is refused with an error instead of being silently ignored or honoured:
:func:`refuse_forced_pickle` is the same check for loaders this project does not call itself
(Lightning's resume from ``--ckpt_path``, which ``train.py`` runs with ``weights_only=True``).

Example::

    state = load_user_file("runs/rho_reference/reference.ckpt", "the reference checkpoint")
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

__all__ = ["FORCE_PICKLE_VARIABLE", "UnsafeLoadError", "load_user_file", "refuse_forced_pickle"]

FORCE_PICKLE_VARIABLE = "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"
TORCH_TRUE_VALUES = ("1", "y", "yes", "true")  # how torch.serialization reads the variable


class UnsafeLoadError(ValueError):
    """A user's file would load through the full pickle loader, or holds objects it may not build."""


def refuse_forced_pickle(path: str | Path, what: str) -> None:
    """Raise when the environment asks torch to load files with the full pickle loader.

    Raises:
        UnsafeLoadError: ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD`` is set to a value torch honours.
    """
    if os.environ.get(FORCE_PICKLE_VARIABLE, "0").lower() in TORCH_TRUE_VALUES:
        raise UnsafeLoadError(
            f"refusing to load {what} {str(path)!r}: {FORCE_PICKLE_VARIABLE} is set, which lets a file run code "
            f"while it loads; unset it (files a user hands over load with weights_only=True only)")


def load_user_file(path: str | Path, what: str, safe_globals: Iterable[Any] = ()) -> Any:
    """The contents of a ``torch.save`` file, loaded on CPU with ``weights_only=True``.

    Args:
        path: the file.
        what: what it is, for errors (e.g. ``"the reference checkpoint"``).
        safe_globals: classes and functions the file may also build (``torch.serialization.safe_globals``).

    Raises:
        UnsafeLoadError: ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD`` is set, or the file holds objects
            beyond tensors, plain containers and ``safe_globals``.
        FileNotFoundError: the file does not exist.
    """
    refuse_forced_pickle(path, what)
    if not Path(path).is_file():
        raise FileNotFoundError(f"{what} {str(path)!r} does not exist")
    try:
        # the context removes what it added on exit: add only what is not allowed already
        allowed = torch.serialization.get_safe_globals()
        with torch.serialization.safe_globals([g for g in safe_globals if g not in allowed]):
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise UnsafeLoadError(
            f"{what} {str(path)!r} is refused: it is not a torch.save file of tensors and plain containers, or it "
            f"holds objects that loading would have to build by running code ({str(e).splitlines()[0]}); "
            "save tensors and plain containers only") from e
