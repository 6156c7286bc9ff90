"""Plain torch models and optimizers (never Lightning): ``gpt`` (the GPT used as learner and proxy),
``optim`` (Muon+AdamW as one optimizer, the optimizer builder, the warmup-cosine schedule)."""

__all__ = ["gpt", "optim"]
