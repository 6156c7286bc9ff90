"""What the offline selectors share: documents and the budget rule (``corpus``), the feature bank
(``features``), per-document quality (``quality``), document embeddings (``embeddings``), a small
proxy GPT trained on a subset and scored on the target (``proxy_train``, ``proxy_reward``) and a
selection's record (``summary``)."""

__all__ = ["corpus", "embeddings", "features", "proxy_reward", "proxy_train", "quality", "summary"]
