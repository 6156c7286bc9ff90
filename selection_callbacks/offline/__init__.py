"""Offline selectors: pool → subset file.

Selectors: ``dsir``, ``warmup_delta``, ``policy``, ``datamask``, ``autodata`` (a package: recipe
search), and ``oracle`` (the labelled ceiling: the target's domains first). Shared pieces: ``corpus``
(documents, budget rule), ``features`` (the feature bank), ``quality`` (per-document quality scores),
``proxy_train`` and ``proxy_reward`` (train a proxy GPT on a subset, score it on the target),
``embeddings``, ``summary`` (what a subset holds); ``select`` runs any selector, ``sharded`` runs the
per-document stages on Ray; ``bench_proxy`` builds an input for the online methods (RHO-LOSS's reference
loss table is ``selection_callbacks.scoring.reference_losses``).
"""

__all__ = [
    "autodata", "bench_proxy", "corpus", "datamask", "dsir", "embeddings", "features", "oracle", "policy", "proxy_reward",
    "proxy_train", "quality", "select", "sharded", "summary", "warmup_delta",
]
