"""Atomic writes: a file or folder appears whole under its final name or not at all."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

__all__ = ["atomic_path", "write_json_atomic"]


def _temp_sibling(path: Path, suffix: str = "") -> Path:
    """``<path>.tmp<pid><suffix>``: a per-process temporary name beside ``path``."""
    return path.with_name(f"{path.name}.tmp{os.getpid()}{suffix}")


@contextmanager
def atomic_path(path: str | Path, suffix: str = "", keep_existing: bool = False) -> Iterator[Path]:
    """Yield a temporary sibling of ``path`` to write into, renamed onto ``path`` when the block succeeds.

    Readers (other ranks, other processes) never see a partial file. On an exception the
    temporary file or folder is removed. ``suffix`` ends the temporary name, for writers that
    append an extension (``np.save`` adds ``.npy``). With ``keep_existing`` a folder that
    another process finished first stays, and this one's copy is dropped.
    """
    path = Path(path)
    tmp = _temp_sibling(path, suffix)
    try:
        yield tmp
        try:
            os.replace(tmp, path)
        except OSError:
            if not (keep_existing and path.exists()):
                raise
            _remove(tmp)
    except BaseException:
        _remove(tmp)
        raise


def write_json_atomic(path: str | Path, data: Any) -> None:
    """``data`` as indented JSON at ``path``, atomically."""
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(data, indent=2))


def _remove(tmp: Path) -> None:
    if tmp.is_dir():
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        tmp.unlink(missing_ok=True)
