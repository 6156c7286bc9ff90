"""GREATS: greedy selection by a one-step Taylor estimate of the target-loss decrease, SGD geometry.

The callback is in ``callback``; its card, ``README.md``, beside it.
"""

from selection_callbacks.methods.greats.callback import GreatsSelection

__all__ = ["GreatsSelection"]
