"""A ``train.py`` checkpoint of a GPT learner as a frozen reference model (RHO-LOSS, ClassAct, reference losses).

The checkpoint is read as data: its ``hyper_parameters["config"]`` (a :class:`GPTConfig`, or its
fields as a mapping, as ``train.py``'s command line saves it) and the
``model.*`` weights of its ``state_dict``, loaded with ``weights_only=True`` (:func:`~selection_callbacks.core.safe_load.load_user_file`) into the plugin's own
:class:`~selection_callbacks.scoring.proxy_models.ProxyLM`. No class of the learner is imported and
no pickled code runs.
"""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

from selection_callbacks.core.safe_load import load_user_file
from selection_callbacks.nn.gpt import GPTConfig
from selection_callbacks.scoring.proxy_models import ProxyLM

__all__ = ["load_reference"]


def load_reference(path: str | Path) -> ProxyLM:
    """The frozen GPT of a ``train.py`` checkpoint: on CPU, eval mode, no gradients.

    Args:
        path: a checkpoint ``train.py`` wrote for a learner whose ``hyper_parameters.config`` is a :class:`GPTConfig`,
            e.g. trained on the target split.

    Returns:
        a :class:`ProxyLM` with the checkpoint's config and weights (``per_sample_loss(batch) -> [N]``).

    Raises:
        FileNotFoundError: no file at ``path``.
        UnsafeLoadError: the file needs the full pickle loader, or ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD`` is set.
        ValueError: the file is not a GPT checkpoint (the message says what it lacks).

    Example::

        reference = load_reference("runs/reference/checkpoints/last.ckpt")
        losses = reference.per_sample_loss({"input_ids": ids})  # [N]
    """
    if not Path(path).is_file():
        raise FileNotFoundError(
            f"reference checkpoint {str(path)!r} does not exist; train one on the target split "
            "(the RHO-LOSS method card has the command)"
        )
    try:
        checkpoint = load_user_file(path, "the reference checkpoint")  # GPTConfig is allowed where it is defined
    except (RuntimeError, EOFError) as err:
        raise ValueError(f"{str(path)!r} is not a checkpoint train.py wrote: {err}") from err
    config = (checkpoint.get("hyper_parameters") or {}).get("config") if isinstance(checkpoint, dict) else None
    if isinstance(config, dict) and set(config) <= {f.name for f in fields(GPTConfig)}:
        config = GPTConfig(**config)
    if not isinstance(config, GPTConfig) or "state_dict" not in checkpoint:
        raise ValueError(
            f"{str(path)!r} is not a GPT learner's checkpoint written by train.py (it needs hyper_parameters.config, "
            "a GPTConfig, and a state_dict); for another architecture, override build_proxy() or pass reference_losses"
        )
    module = ProxyLM(config)
    weights = {k: v for k, v in checkpoint["state_dict"].items() if k.startswith("model.")}
    try:
        module.load_state_dict(weights)
    except RuntimeError as err:
        raise ValueError(f"{str(path)!r}: its weights do not fit its own config: {err}") from err
    return module.eval().requires_grad_(False)
