"""Online data selection for LLM pre-training, as PyTorch Lightning callbacks."""

from selection_callbacks.callbacks.base import Scores, SelectionCallback
from selection_callbacks.callbacks.recorder import RunRecorder
from selection_callbacks.data.datamodule import PoolDataModule
from selection_callbacks.methods import (
    ClassActSelection,
    GreatsSelection,
    HighLossSelection,
    OPUSSelection,
    OracleDomainSelection,
    RandomSelection,
    RhoLossSelection,
)

__all__ = [
    "ClassActSelection",
    "GreatsSelection",
    "HighLossSelection",
    "OPUSSelection",
    "OracleDomainSelection",
    "PoolDataModule",
    "RandomSelection",
    "RhoLossSelection",
    "RunRecorder",
    "Scores",
    "SelectionCallback",
]
__version__ = "0.1.0"
