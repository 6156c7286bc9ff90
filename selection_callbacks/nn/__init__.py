"""Plain torch models and optimizers: the GPT used as learner and proxy, Muon+AdamW, the LR schedule."""
