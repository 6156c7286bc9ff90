"""Plain torch models and optimizers (never Lightning): ``gpt`` (the GPT used as learner and proxy),
``optim`` (Muon+AdamW as one optimizer, the optimizer builder, the warmup-cosine schedule), ``heads``
(which Linear is a model's output head), ``flops`` (matmul FLOPs per token, for cost models),
``checkpointing`` (activation checkpointing of a model's blocks)."""

__all__ = ["checkpointing", "flops", "gpt", "heads", "optim"]
