"""A trained reference model read from files, as data: no pickled code runs and no learner class is imported.

Two kinds of files:

- a checkpoint of a ``LitLanguageModel`` (the learners of ``train.py``'s ``models/``: ``LitGPT``,
  ``LitCausalLM``), read with ``weights_only=True``
  (:func:`~selection_callbacks.core.safe_load.load_user_file`). Its ``hyper_parameters["config"]``
  names the architecture: a :class:`GPTConfig` (or its fields as a mapping) is built as a
  :class:`~selection_callbacks.scoring.proxy_models.ProxyLM`; a mapping with ``model_type`` (a
  transformers config's fields, as ``LitCausalLM`` saves them) as a
  :class:`~selection_callbacks.scoring.proxy_models.CausalLMProxy`. Both hold the model under
  ``model`` as the learners do, so the checkpoint's ``model.*`` weights load as they are.
- a Hugging Face model folder (``save_pretrained``): the architecture from ``config.json`` (no
  remote code), the weights from its ``*.safetensors`` files only; a folder with only
  ``pytorch_model.bin`` (a pickle) is refused.

Another learner's checkpoint (an architecture of one's own) is read with :func:`checkpoint_weights`
into a module built by one's own code.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from selection_callbacks.core.safe_load import load_user_file
from selection_callbacks.nn.gpt import GPTConfig
from selection_callbacks.scoring.proxy_models import CausalLMProxy, ProxyLM

__all__ = ["checkpoint_weights", "read_checkpoint", "read_pretrained_folder"]

WEIGHTS_PREFIX = "model."


def checkpoint_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """The ``model.*`` weights of a ``LitLanguageModel`` checkpoint, prefix removed (what ``self.model`` loads).

    For a learner of one's own architecture: build the model and load these into it, then pass the
    module as the reference.

    Example::

        model = MyLM(width=64)
        model.load_state_dict(checkpoint_weights("runs/reference/reference.ckpt"))
        RhoLossSelection(ratio=0.5, reference=model)

    Raises:
        FileNotFoundError: no file at ``path``.
        UnsafeLoadError: the file needs the full pickle loader.
        ValueError: the file is not a Lightning checkpoint with ``model.*`` weights.
    """
    state = _read(path).get("state_dict")
    weights = {k[len(WEIGHTS_PREFIX):]: v for k, v in (state or {}).items() if k.startswith(WEIGHTS_PREFIX)}
    if not weights:
        raise ValueError(f"{str(path)!r} holds no model.* weights in a state_dict: it is not a checkpoint of a "
                         "LightningModule whose network is self.model")
    return weights


def read_checkpoint(path: str | Path) -> nn.Module:
    """The model of a ``LitGPT`` or ``LitCausalLM`` checkpoint, with the per-sample loss protocol, on CPU.

    Returns:
        a :class:`ProxyLM` (a GPT config) or a :class:`CausalLMProxy` (a transformers config with ``model_type``),
        holding the checkpoint's weights.

    Raises:
        FileNotFoundError: no file at ``path``.
        UnsafeLoadError: the file needs the full pickle loader, or ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD`` is set.
        ValueError: the file is not such a checkpoint (the message says what it lacks and what to do instead).
    """
    checkpoint = _read(path)
    config = (checkpoint.get("hyper_parameters") or {}).get("config")
    if isinstance(config, Mapping) and set(config) <= {f.name for f in fields(GPTConfig)}:
        config = GPTConfig(**config)
    if isinstance(config, GPTConfig):
        module: nn.Module = ProxyLM(config)
    elif isinstance(config, Mapping) and "model_type" in config:
        module = CausalLMProxy(_transformers_config(config, str(path)))
    else:
        raise ValueError(
            f"{str(path)!r} is not a checkpoint of LitGPT or LitCausalLM (its hyper_parameters.config is "
            f"{type(config).__name__}, neither a GPTConfig nor a transformers config with model_type); for another "
            "architecture build the model, load checkpoint_weights(path) into it and pass it as reference=module"
        )
    weights = {k: v for k, v in (checkpoint.get("state_dict") or {}).items() if k.startswith(WEIGHTS_PREFIX)}
    try:
        module.load_state_dict(weights)
    except RuntimeError as err:
        raise ValueError(f"{str(path)!r}: its weights do not fit its own config: {err}") from err
    return module


def read_pretrained_folder(path: str | Path) -> nn.Module:
    """The causal LM a Hugging Face ``save_pretrained`` folder holds, on CPU, from safetensors only.

    ``AutoModelForCausalLM.from_pretrained(path, local_files_only=True, use_safetensors=True)``: the
    class from ``config.json`` (no remote code, nothing downloaded), the weights from the folder's
    ``*.safetensors`` (sharded or not; tied weights tied as the config says).

    Raises:
        FileNotFoundError: the folder has no ``config.json``.
        ValueError: the folder has no ``*.safetensors`` (``pytorch_model.bin`` is a pickle and is never read).
    """
    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"reference folder {str(path)!r} has no config.json: pass a folder written by "
                                "save_pretrained(), or a train.py checkpoint file")
    if not any(folder.glob("*.safetensors")):
        raise ValueError(f"reference folder {str(path)!r} holds no *.safetensors weights (pickled weights such as "
                         "pytorch_model.bin are never loaded): write it with save_pretrained(), whose default is "
                         "safetensors")
    from transformers import AutoModelForCausalLM  # a user with a Hugging Face folder has transformers

    return AutoModelForCausalLM.from_pretrained(str(folder), local_files_only=True, use_safetensors=True,
                                                trust_remote_code=False)


def _read(path: str | Path) -> dict[str, Any]:
    """A checkpoint's contents, loaded with ``weights_only=True`` (GPTConfig is allowed where it is defined)."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"reference checkpoint {str(path)!r} does not exist; train one on the target split "
                                "(the RHO-LOSS method card has the command)")
    try:
        checkpoint = load_user_file(path, "the reference checkpoint")
    except (RuntimeError, EOFError) as err:
        raise ValueError(f"{str(path)!r} is not a checkpoint train.py wrote: {err}") from err
    if not isinstance(checkpoint, dict):
        raise ValueError(f"{str(path)!r} holds a {type(checkpoint).__name__}, not a checkpoint train.py wrote")
    return checkpoint


def _transformers_config(fields_of: Mapping[str, Any], source: str) -> Any:
    """The transformers config that a checkpoint's mapping with ``model_type`` describes."""
    from transformers import AutoConfig  # a checkpoint of a transformers learner: its user has transformers

    values = dict(fields_of)
    model_type = values.pop("model_type")
    values.pop("transformers_version", None)
    try:
        return AutoConfig.for_model(model_type, **values)
    except ValueError as err:
        raise ValueError(f"{source}: model_type {model_type!r} is not a transformers architecture ({err})") from err
