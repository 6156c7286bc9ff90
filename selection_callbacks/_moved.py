"""Old module paths kept as aliases of the modules that now hold their code.

An alias file holds only ``alias(__name__, "<new module>")``: imported, it *is* the new module
(``sys.modules`` maps the old name to it, so monkeypatching either name patches both); run with
``python -m <old path>``, it runs the new module as ``__main__``.
"""

from __future__ import annotations

import importlib
import runpy
import sys

__all__ = ["alias"]


def alias(name: str, target: str) -> None:
    """Make the module ``name`` (an old path) the module ``target``, or run ``target`` when ``name`` is ``__main__``."""
    if name == "__main__":
        runpy.run_module(target, run_name="__main__", alter_sys=True)
        return
    sys.modules[name] = importlib.import_module(target)
