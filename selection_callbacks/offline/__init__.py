"""Offline selectors: pool → subset file.

One subpackage per selector, its ``selector`` module beside its card ``README.md``: ``dsir``,
``warmup_delta``, ``policy``, ``datamask``, ``oracle`` (the labelled ceiling: the target's domains
first) and ``autodata`` (recipe search; its code recipes run in ``autodata.sandbox``). ``common`` holds
what they share: documents and the budget rule, the feature bank (whose ``dsir`` column is DSIR's),
quality scores, embeddings, the proxy GPT's training and rewards, a selection's record. ``select`` runs
any selector, ``sharded`` runs the per-document stages on Ray; ``bench_docs`` (Bench-Docs: the pool
documents nearest a benchmark) builds an input for the online methods (RHO-LOSS's reference loss table is
``selection_callbacks.scoring.reference_losses``).
"""

__all__ = [
    "autodata", "bench_docs", "common", "datamask", "dsir", "oracle", "policy", "select",
    "sharded", "warmup_delta",
]
