"""The learners: ``language_model`` (what they share: per-sample loss protocol, bits-per-byte validation,
AdamW or Muon+AdamW), ``lit_gpt`` (this project's GPT), ``hf_causal_lm`` (a Hugging Face causal LM built
from its config) and ``reference`` (a ``train.py`` checkpoint as a frozen reference).

``LitGPT`` and ``LitCausalLM`` load on first use, so importing this package imports neither Lightning
nor transformers (``--model selection_callbacks.learner.LitCausalLM`` resolves through them).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "LitLanguageModel": "selection_callbacks.learner.language_model",
    "LitGPT": "selection_callbacks.learner.lit_gpt",
    "LitCausalLM": "selection_callbacks.learner.hf_causal_lm",
}

__all__ = ["hf_causal_lm", "language_model", "lit_gpt", "reference", *sorted(_EXPORTS)]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'selection_callbacks.learner' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value
