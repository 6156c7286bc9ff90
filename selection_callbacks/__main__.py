"""``python -m selection_callbacks``: the ``selection-callbacks`` command (see :mod:`selection_callbacks.cli`)."""

from selection_callbacks.cli import main

raise SystemExit(main(prog="python -m selection_callbacks"))
