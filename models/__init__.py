"""The learners ``train.py``, the benchmark and the tests train: LightningModules with the per-sample loss protocol.

``language_model`` (``LitLanguageModel``: what they share, bits-per-byte validation, AdamW or
Muon+AdamW), ``lit_gpt`` (``LitGPT``: the plugin's GPT as the learner), ``hf_causal_lm``
(``LitCausalLM``: a Hugging Face causal LM built from its config). ``LitCausalLM`` loads on first
use, so importing this package does not import transformers (``--model models.LitCausalLM``
resolves through it). The plugin, ``selection_callbacks``, never imports this package.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "LitLanguageModel": "models.language_model",
    "LitGPT": "models.lit_gpt",
    "LitCausalLM": "models.hf_causal_lm",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'models' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value
