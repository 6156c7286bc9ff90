"""Online selection methods, one per folder: its callback (``<method>/callback.py``) and its card (``<method>/README.md``).

``bases`` holds what several methods share: ``GhostSelection`` and ``ProxySelection``.
"""

from selection_callbacks.methods.classact import ClassActSelection
from selection_callbacks.methods.greats import GreatsSelection
from selection_callbacks.methods.high_loss import HighLossSelection
from selection_callbacks.methods.opus import OPUSSelection
from selection_callbacks.methods.oracle import OracleDomainSelection
from selection_callbacks.methods.random import RandomSelection
from selection_callbacks.methods.rho import RhoLossSelection

__all__ = [
    "ClassActSelection",
    "GreatsSelection",
    "HighLossSelection",
    "OPUSSelection",
    "OracleDomainSelection",
    "RandomSelection",
    "RhoLossSelection",
]
