"""The learners ``train.py``, the benchmark and the tests train: LightningModules with the per-sample loss protocol.

``language_model`` (``LitLanguageModel``: what they share, bits-per-byte validation, AdamW or
Muon+AdamW), ``lit_gpt`` (``LitGPT``: the plugin's GPT as the learner), ``hf_causal_lm``
(``LitCausalLM``: a Hugging Face causal LM built from its config). ``LitCausalLM`` loads on first
use (``--model models.LitCausalLM`` resolves through it). The plugin, ``selection_callbacks``, never imports this package.
"""

from __future__ import annotations

from typing import Any

from models.language_model import LitLanguageModel
from models.lit_gpt import LitGPT

__all__ = ["LitCausalLM", "LitGPT", "LitLanguageModel"]


def __getattr__(name: str) -> Any:
    if name == "LitCausalLM":  # the Hugging Face wrapper loads only when asked for
        from models.hf_causal_lm import LitCausalLM

        return LitCausalLM
    raise AttributeError(f"module 'models' has no attribute {name!r}")
