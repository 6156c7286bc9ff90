"""Learned policy: a linear scorer over the feature bank, trained by REINFORCE on proxy rewards. The
selector is in ``selector``; its card, ``README.md``, beside it."""

from selection_callbacks.offline.policy.selector import PolicyConfig, select_policy

__all__ = ["PolicyConfig", "select_policy"]
