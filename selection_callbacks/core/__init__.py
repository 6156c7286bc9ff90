"""The framework-free bottom layer (torch, numpy and pyarrow only; never Lightning).

``contract`` (the superbatch dict: its size, per-sample keys, in-place subsetting), ``selection``
(the pure selection: scores in, chosen rows out; ``Scores``, ``SelectionRecord``), ``sampling``
(the rules: top-K, Gumbel-top-K, uniform, sequential Boltzmann), ``rng`` (per-micro-batch
generators), ``arguments`` (pieces the command-line tools share), ``domains`` (codes to names),
``io`` (atomic writes), ``safe_load`` (users' files loaded weights-only), ``ledger_store`` (the ledger's
parquet shards), ``rank_correlation`` (Spearman, for score diagnostics), ``costs`` (what selection costs: a selector's
extra passes per model and each stage's seconds and peak memory), ``machine_load`` (other processes' CPUs).
"""

__all__ = [
    "arguments", "contract", "costs", "domains", "io", "ledger_store", "machine_load", "rank_correlation",
    "rng", "safe_load", "sampling", "selection",
]
