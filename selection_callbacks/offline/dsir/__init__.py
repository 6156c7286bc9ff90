"""DSIR: importance resampling toward the target with hashed n-gram features. The selector is in
``selector``; its card, ``README.md``, beside it."""

from selection_callbacks.offline.dsir.selector import DSIRConfig, select_dsir

__all__ = ["DSIRConfig", "select_dsir"]
