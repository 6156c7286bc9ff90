"""``python -m selection_callbacks.offline.autodata`` (old path of ``selection-callbacks autodata``)."""

from selection_callbacks.offline.autodata.search import main

main()
