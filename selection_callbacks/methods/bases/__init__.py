"""The bases a method builds on: ``ghost`` (``GhostSelection``: scores from per-sample gradients against a
target direction) and ``proxy`` (``ProxySelection``: scores from small models trained next to the learner)."""

from selection_callbacks.methods.bases.ghost import GhostSelection
from selection_callbacks.methods.bases.proxy import ProxySelection

__all__ = ["GhostSelection", "ProxySelection"]
