"""Online selection methods, one per file."""

from selection_callbacks.methods.greats import GreatsSelection
from selection_callbacks.methods.high_loss import HighLossSelection
from selection_callbacks.methods.opus import OPUSSelection
from selection_callbacks.methods.oracle import OracleDomainSelection
from selection_callbacks.methods.random import RandomSelection

__all__ = ["GreatsSelection", "HighLossSelection", "OPUSSelection", "OracleDomainSelection", "RandomSelection"]
