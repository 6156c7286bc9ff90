"""OPUS: optimizer-induced projected utility selection. The callback is in ``callback``; its card, ``README.md``, beside it."""

from selection_callbacks.methods.opus.callback import OPUSSelection

__all__ = ["OPUSSelection"]
