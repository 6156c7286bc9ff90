"""Offline selectors: pool → subset file.

Selectors: ``dsir``, ``warmup_delta``, ``policy``, ``datamask``, ``autodata`` (a package: recipe
search), and ``oracle`` (the labelled ceiling: the target's domains first). ``common`` holds what
they share (documents and the budget rule, the feature bank, quality scores, embeddings, the proxy
GPT's training and rewards, a selection's record); ``select`` runs any selector, ``sharded`` runs the
per-document stages on Ray; ``bench_docs`` and ``reference_losses`` build inputs for the online methods.
"""

__all__ = [
    "autodata", "bench_docs", "common", "datamask", "dsir", "oracle", "policy", "reference_losses", "select",
    "sharded", "warmup_delta",
]
