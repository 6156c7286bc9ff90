"""Every Lightning face of the library: the selection callback bases, the ledger, the dashboard and the run recorder.

``base`` (``SelectionCallback``: score, choose K, subset the batch), ``ghost`` (``GhostSelection``:
the ghost-gradient methods' plumbing), ``proxy`` (``ProxySelection``: methods with proxy models),
``ledger_writer`` (``SelectionLedger``), ``dashboard`` (``SelectionDashboard``), ``recorder``
(``RunRecorder``).
"""

from selection_callbacks.callbacks.base import SelectionCallback
from selection_callbacks.callbacks.dashboard import SelectionDashboard
from selection_callbacks.callbacks.ghost import GhostSelection
from selection_callbacks.callbacks.ledger_writer import SelectionLedger
from selection_callbacks.callbacks.proxy import ProxySelection
from selection_callbacks.callbacks.recorder import RunRecorder

__all__ = ["GhostSelection", "ProxySelection", "RunRecorder", "SelectionCallback", "SelectionDashboard", "SelectionLedger"]
