"""The Lightning faces every method shares: the selection callback base, the ledger, the dashboard and the run recorder.

``base`` (``SelectionCallback``: score, choose K, subset the batch), ``ledger_writer``
(``SelectionLedger``), ``dashboard`` (``SelectionDashboard``), ``recorder`` (``RunRecorder``), ``protocols`` (what a method needs from the learner and the data, as
errors), ``stack`` (the training stacks a method serves: compiled, FSDP2, activation checkpointing). The
method bases (``GhostSelection``, ``ProxySelection``) are in :mod:`selection_callbacks.methods.bases`.
"""

from selection_callbacks.callbacks.base import SelectionCallback
from selection_callbacks.callbacks.dashboard import SelectionDashboard
from selection_callbacks.callbacks.ledger_writer import SelectionLedger
from selection_callbacks.callbacks.recorder import RunRecorder

__all__ = ["RunRecorder", "SelectionCallback", "SelectionDashboard", "SelectionLedger"]
