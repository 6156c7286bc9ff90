"""Where tokenized splits and feature banks are cached."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["default_cache_dir"]


def default_cache_dir() -> Path:
    """``$SELECTION_CACHE`` or ``~/.cache/selection_callbacks``."""
    return Path(os.environ.get("SELECTION_CACHE", Path.home() / ".cache" / "selection_callbacks"))
