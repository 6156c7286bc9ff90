"""Warmup delta: the documents a pool proxy learns most about while it trains, tails trimmed. The
selector is in ``selector``; its card, ``README.md``, beside it."""

from selection_callbacks.offline.warmup_delta.selector import WarmupDeltaConfig, select_warmup_delta

__all__ = ["WarmupDeltaConfig", "select_warmup_delta"]
