"""Pure torch scoring (never Lightning): what a method computes per candidate.

``losses`` (per-token and per-sample LM losses, the ``per_sample_loss`` protocol), ``ghost`` (the
ghost-gradient engine: utilities and sketches without per-sample gradients), ``maps`` (each optimizer's
one-step map P), ``sketch`` (CountSketch, TensorSketch), ``windows`` (seeded
scoring windows), ``proxy_models`` (small proxy LMs: build, train a step, count the cost),
``reference`` (the frozen reference of RHO-LOSS and ClassAct: its source, model and state),
``reference_files`` (a reference read from a checkpoint or a Hugging Face folder without running pickled
code), ``reference_losses`` (a reference's losses per row, looked up by ``sample_id``), ``reliability``
(split-half reliability of the ghost utilities).
"""

__all__ = [
    "ghost", "losses", "maps", "proxy_models", "reference", "reference_files", "reference_losses", "reliability",
    "sketch", "windows",
]
