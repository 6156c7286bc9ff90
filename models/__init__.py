"""Old home of the GPT learner, kept as aliases: the code is in ``selection_callbacks.nn`` and ``selection_callbacks.learner``."""

from selection_callbacks.learner.lit_gpt import LitGPT
from selection_callbacks.nn.gpt import GPT, GPTConfig

__all__ = ["GPT", "GPTConfig", "LitGPT"]
