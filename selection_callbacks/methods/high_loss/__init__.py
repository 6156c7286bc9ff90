"""High-loss selection: the K candidates the learner currently predicts worst. The callback is in ``callback``; its card, ``README.md``, beside it."""

from selection_callbacks.methods.high_loss.callback import HighLossSelection

__all__ = ["HighLossSelection"]
