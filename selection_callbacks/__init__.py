"""Online data selection for LLM pre-training, as PyTorch Lightning callbacks.

Every callback a user adds to a ``lightning.Trainer`` is importable from here. The names load on
first use, so importing a framework-free module (``selection_callbacks.core``, ``.scoring``,
``.nn``) does not import Lightning.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "ClassActSelection": "selection_callbacks.methods.classact",
    "GreatsSelection": "selection_callbacks.methods.greats",
    "HighLossSelection": "selection_callbacks.methods.high_loss",
    "OPUSSelection": "selection_callbacks.methods.opus",
    "OracleDomainSelection": "selection_callbacks.methods.oracle",
    "RandomSelection": "selection_callbacks.methods.random",
    "RhoLossSelection": "selection_callbacks.methods.rho",
    "SelectionCallback": "selection_callbacks.callbacks.base",
    "Stack": "selection_callbacks.callbacks.stack",
    "GhostSelection": "selection_callbacks.methods.bases.ghost",
    "ProxySelection": "selection_callbacks.methods.bases.proxy",
    "SelectionLedger": "selection_callbacks.callbacks.ledger_writer",
    "SelectionDashboard": "selection_callbacks.callbacks.dashboard",
    "RunRecorder": "selection_callbacks.callbacks.recorder",
    "PoolDataModule": "selection_callbacks.data.datamodule",
    "Scores": "selection_callbacks.core.selection",
    "SelectionRecord": "selection_callbacks.core.selection",
    "MuonWithAdamW": "selection_callbacks.nn.optim",
}

__all__ = sorted(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'selection_callbacks' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
