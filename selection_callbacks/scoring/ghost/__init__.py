"""The ghost-gradient engine, in pieces.

``engine`` (``GhostEngine``: the scoring call, its passes, its layer groups, the sketchers),
``capture`` (the ``Capture`` contract, how a pass obtains each layer's inputs and output gradients, and
``HookCapture``, by hooks on the eager module), ``roots`` (the tensors its backward differentiates to, so that it
runs through every scored layer whatever the blocks' wiring), ``layers`` (which layers are scored, which share a weight),
``scorers`` (the registry layer type → scorer, ``register_scorer``) with one module per scorer (``linear``,
``embedding``, ``tied``) and ``state`` (what one pass holds).
"""

__all__ = ["capture", "embedding", "engine", "layers", "linear", "roots", "scorers", "state", "tied"]
