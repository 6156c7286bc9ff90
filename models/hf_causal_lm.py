"""A Hugging Face ``transformers`` causal LM, built from its config (random init), as the learner."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import torch
import yaml
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from models.language_model import LitLanguageModel

__all__ = ["LitCausalLM", "causal_lm_config"]


class LitCausalLM(LitLanguageModel):
    """Any ``AutoModelForCausalLM`` architecture (Llama, Qwen2, GPT-2, ...) trained on (selected) superbatches.

    The model is ``AutoModelForCausalLM.from_config(config)``: random weights, nothing downloaded.
    It has :class:`~models.lit_gpt.LitGPT`'s contract and hyperparameters:
    ``per_sample_loss(batch) -> Tensor[N]`` (mean next-token cross-entropy of each row over its
    ``labels``, or ``input_ids`` shifted by one, where ``loss_mask`` is 1), ``val/loss`` and
    ``val/bpb``, AdamW or Muon+AdamW split by :func:`~selection_callbacks.nn.optim.param_split`
    under a warmup-cosine schedule. Rows are packed (no padding), so no attention mask is passed.

    Example::

        model = LitCausalLM({"model_type": "llama", "vocab_size": 320, "hidden_size": 64,
                             "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4})
        trainer = L.Trainer(callbacks=[HighLossSelection(ratio=0.5)], max_steps=100)

        python train.py fit --config configs/scale/cpu-tiny.yaml --config configs/method/random.yaml \\
            --model models.LitCausalLM --model.config configs/model/tiny-llama.yaml \\
            --model.config.num_hidden_layers 4 ...   # the file's fields, one changed

    Args:
        config: the transformers config: a YAML or JSON file of its fields (a model folder's
            ``config.json`` works as is), a dict of them, or a ``PretrainedConfig``. Files and dicts
            name the architecture by ``model_type`` (``"llama"``, ``"gpt2"``, ``"qwen2"``: the
            ``model_type`` of ``LlamaConfig``, ``GPT2Config``, ``Qwen2Config``); the other fields are
            that class's arguments (sizes, ``tie_word_embeddings``, dropout, ...).
        optimizer: ``"adamw"``, or ``"muon"`` (Muon on hidden matrices, AdamW on the rest).
        lr: AdamW learning rate (peak).
        weight_decay: AdamW decoupled weight decay on ≥2-D weights.
        betas: AdamW betas.
        muon_lr: Muon learning rate (peak).
        muon_momentum: Muon momentum.
        muon_weight_decay: Muon decoupled weight decay.
        warmup_steps: linear warmup steps.
        min_lr_ratio: final LR as a fraction of the peak (cosine decay over the run).
        compile: ``torch.compile`` (inductor) each transformer block in place (docs/stack.md).
        activation_checkpointing: recompute each block's activations in the backward (non-reentrant).
    """

    max_len_field = "max_position_embeddings"

    def __init__(
        self,
        config: str | dict[str, Any] | PretrainedConfig,
        optimizer: Literal["adamw", "muon"] = "adamw",
        lr: float = 3e-3,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        muon_lr: float = 0.02,
        muon_momentum: float = 0.95,
        muon_weight_decay: float = 0.0,
        warmup_steps: int = 20,
        min_lr_ratio: float = 0.1,
        compile: bool = False,
        activation_checkpointing: bool = False,
    ) -> None:
        hf_config = causal_lm_config(config)
        super().__init__(hf_config.vocab_size, compile, activation_checkpointing)
        self.save_hyperparameters(ignore=["config"])
        self.hparams["config"] = hf_config.to_diff_dict()  # a checkpoint rebuilds the model without the file
        self.model = AutoModelForCausalLM.from_config(hf_config)
        self.config = self.model.config

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits [N, T, V] for ``input_ids`` [N, T]."""
        return self.model(input_ids=input_ids, use_cache=False).logits

    def transformer_blocks(self) -> list[torch.nn.Module]:
        """The decoder layers: the modules whose class transformers lists in ``_no_split_modules``."""
        names = set(self.model._no_split_modules or ())
        return [m for m in self.model.modules() if type(m).__name__ in names]


def causal_lm_config(config: str | dict[str, Any] | PretrainedConfig) -> PretrainedConfig:
    """The ``PretrainedConfig`` that ``config`` describes (a file, a dict with ``model_type``, or a config as is)."""
    source = "the config"
    if isinstance(config, (str, Path)):
        path, source = Path(config), f"config file {str(config)!r}"
        if not path.is_file():
            raise FileNotFoundError(f"{source} does not exist; pass a YAML/JSON file of a transformers config's "
                                    "fields (e.g. configs/model/tiny-llama.yaml) or a dict with model_type")
        config = yaml.safe_load(path.read_text())  # YAML reads JSON too
    if isinstance(config, dict):
        fields = dict(config)
        model_type = fields.pop("model_type", None)
        if model_type is None:
            raise ValueError(f"{source} has no model_type: name the architecture (model_type: llama, gpt2, qwen2, "
                             "...), e.g. --model.config configs/model/tiny-llama.yaml")
        try:
            config = AutoConfig.for_model(model_type, **fields)
        except ValueError as err:
            raise ValueError(f"{source}: model_type {model_type!r} is not a transformers architecture ({err})") from err
    if not isinstance(config, PretrainedConfig):
        raise TypeError(f"{source} is a {type(config).__name__}; expected a mapping of transformers config fields")
    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise ValueError(f"{source}: model_type {config.model_type!r} ({type(config).__name__}) has no causal-LM "
                         "class in transformers' AutoModelForCausalLM; choose a decoder such as llama, gpt2 or qwen2")
    return config
