"""Online selection methods, one per file."""

from selection_callbacks.methods.high_loss import HighLossSelection
from selection_callbacks.methods.oracle import OracleDomainSelection
from selection_callbacks.methods.random import RandomSelection

__all__ = ["HighLossSelection", "OracleDomainSelection", "RandomSelection"]
