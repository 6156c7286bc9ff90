"""``python -m selection_callbacks.offline.autodata``: the same command as ``selection-callbacks autodata``."""

from selection_callbacks.offline.autodata.search import main

main()
