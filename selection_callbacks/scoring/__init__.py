"""Pure torch scoring (never Lightning): what a method computes per candidate.

``losses`` (per-token and per-sample LM losses, the ``per_sample_loss`` protocol), ``ghost`` (the
ghost-gradient engine: utilities and sketches without per-sample gradients), ``maps`` (each optimizer's
one-step map P), ``sketch`` (CountSketch, TensorSketch), ``windows`` (seeded
scoring windows), ``proxy_models`` (small proxy LMs: build, train a step, count the cost),
``reference`` (a reference checkpoint read as weights into a proxy LM), ``reliability`` (split-half
reliability of the ghost utilities).
"""

__all__ = ["ghost", "losses", "maps", "proxy_models", "reference", "reliability", "sketch", "windows"]
