"""AutoData: search selection recipes with proxy-training feedback (``search``), the recipe language
(``recipe``), the proposers (``proposers``) and the search report (``report``)."""

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
