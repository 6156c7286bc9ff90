"""The offline labelled oracle: the target's domains first in the whole pool (a ceiling, it reads
labels). The selector is in ``selector``; its card, ``README.md``, beside it."""

from selection_callbacks.offline.oracle.selector import OracleConfig, select_oracle

__all__ = ["OracleConfig", "select_oracle"]
