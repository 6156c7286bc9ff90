"""DATAMASK: joint quality–diversity subset selection by policy-gradient mask learning. The selector
is in ``selector``; its card, ``README.md``, beside it."""

from selection_callbacks.offline.datamask.selector import DatamaskConfig, select_datamask

__all__ = ["DatamaskConfig", "select_datamask"]
