"""AutoData: search selection recipes with proxy-training feedback (``search``), the recipe language
(``recipe``), the proposers (``proposers``; an agent command's answer read by ``agent_io`` through
``capped``) and the search report (``report``). Code recipes run in ``sandbox`` (the parent side,
``sandbox_limits``), whose child (``sandbox_child``) confines itself with ``sandbox_guard``."""

from selection_callbacks.offline.autodata.search import (
    AutoDataConfig,
    Search,
    SearchConfig,
    TrialStore,
    build_parser,
    main,
    select_autodata,
    subset_hash,
)

__all__ = ["AutoDataConfig", "Search", "SearchConfig", "TrialStore", "build_parser", "main", "select_autodata", "subset_hash"]
