"""AutoData: search selection recipes with proxy-training feedback (``search``), the recipe schema
(``schema``) and how a recipe selects (``evaluation``), the proposers (``proposers``; an agent
command's answer read by ``agent_io`` through ``capped``) and their surrogate model (``surrogate``),
and the search report (``report``). Code recipes run in the ``sandbox`` subpackage. Its card,
``README.md``, beside it."""

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
