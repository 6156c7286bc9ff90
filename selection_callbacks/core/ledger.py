"""Old path of the ledger, kept as an alias: the callback is in :mod:`selection_callbacks.callbacks.ledger_writer`,
the files and readers in :mod:`selection_callbacks.core.ledger_store`."""

from selection_callbacks.callbacks.ledger_writer import SelectionLedger
from selection_callbacks.core.ledger_store import SCHEMA, LedgerError, ledger_folder, read_ledger, read_meta, truncate_ledger

__all__ = ["SCHEMA", "LedgerError", "SelectionLedger", "ledger_folder", "read_ledger", "read_meta", "truncate_ledger"]
