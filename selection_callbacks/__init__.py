"""Online data selection for LLM pre-training, as PyTorch Lightning callbacks."""

from selection_callbacks.core.callback import SelectionCallback
from selection_callbacks.data.datamodule import PoolDataModule
from selection_callbacks.methods import HighLossSelection, RandomSelection

__all__ = ["HighLossSelection", "PoolDataModule", "RandomSelection", "SelectionCallback"]
__version__ = "0.1.0"
