"""The GPT learner and its proxies."""

from models.gpt import GPT, GPTConfig
from models.lit_gpt import LitGPT

__all__ = ["GPT", "GPTConfig", "LitGPT"]
