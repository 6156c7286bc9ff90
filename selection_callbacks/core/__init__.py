"""The framework-free bottom layer (torch, numpy and pyarrow only; never Lightning).

``contract`` (the superbatch dict: its size, per-sample keys, in-place subsetting), ``selection``
(the pure selection: scores in, chosen rows out; ``Scores``, ``SelectionRecord``), ``sampling``
(the rules: top-K, Gumbel-top-K, uniform, sequential Boltzmann), ``rng`` (per-micro-batch
generators), ``arguments`` (pieces the command-line tools share), ``domains`` (codes to names), ``io`` (atomic writes), ``ledger_store`` (the ledger's
parquet shards), ``rank_correlation`` (Spearman, for score diagnostics), ``pass_counts`` (a selector's extra passes per model).
"""

__all__ = ["arguments", "contract", "domains", "io", "ledger_store", "pass_counts", "rank_correlation", "rng", "sampling", "selection"]
