"""Oracle: the labelled-domain reference, candidates from the target's domains first. The callback is in ``callback``; its card, ``README.md``, beside it."""

from selection_callbacks.methods.oracle.callback import OracleDomainSelection

__all__ = ["OracleDomainSelection"]
