"""Random selection: K of N uniformly, the baseline every method is measured against. The callback is in ``callback``; its card, ``README.md``, beside it."""

from selection_callbacks.methods.random.callback import RandomSelection

__all__ = ["RandomSelection"]
