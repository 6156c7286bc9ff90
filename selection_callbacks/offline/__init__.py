"""Offline selectors: pool → subset file.

Selectors: ``dsir``, ``warmup_delta``, ``policy``, ``datamask``, ``autodata`` (a package: recipe
search), and ``oracle`` (the labelled ceiling: the target's domains first). Shared pieces: ``corpus`` (documents, budget rule), ``features`` (the feature bank),
``proxy_train`` and ``proxy_reward`` (train a proxy GPT on a subset, score it on the target),
``embeddings``; ``select`` runs any selector; ``bench_proxy`` and ``reference_losses`` build
inputs for the online methods.
"""

__all__ = [
    "autodata", "bench_proxy", "corpus", "datamask", "dsir", "embeddings", "features", "oracle", "policy", "proxy_reward",
    "proxy_train", "reference_losses", "select", "warmup_delta",
]
