"""Plain torch models and optimizers (never Lightning): ``gpt`` (the GPT used as learner and proxy),
``optim`` (Muon+AdamW as one optimizer, the optimizer builder, the warmup-cosine schedule), ``heads``
(which Linear is a model's output head), ``flops`` (matmul FLOPs per token, for cost models)."""

__all__ = ["flops", "gpt", "heads", "optim"]
