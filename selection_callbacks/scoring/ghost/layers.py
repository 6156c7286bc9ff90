"""Which layers of a model the ghost engine scores, which of them share one weight, and their parameters as the
optimizer holds them."""

from __future__ import annotations

from typing import Literal

import torch.nn as nn
from torch.distributed.fsdp import FSDPModule

from selection_callbacks.nn.heads import output_heads
from selection_callbacks.nn.optim import conv1d_type


def linear_kind(module: nn.Module) -> Literal["linear", "conv1d"] | None:
    """``"linear"`` for ``nn.Linear`` (weight [out, in]), ``"conv1d"`` for transformers' ``Conv1D`` (weight [in, out])."""
    if isinstance(module, nn.Linear):
        return "linear"
    conv1d = conv1d_type()
    return "conv1d" if conv1d is not None and isinstance(module, conv1d) else None


def unscorable_layers(model: nn.Module) -> list[str]:
    """Modules holding a trainable parameter of ≥ 2 dimensions the engine has no ghost form for: neither
    ``nn.Linear``, ``Conv1D`` nor ``nn.Embedding`` (norms, rotary tables and activations hold none)."""
    return [name for name, module in model.named_modules()
            if linear_kind(module) is None and not isinstance(module, nn.Embedding)
            and any(p.ndim >= 2 and p.requires_grad for p in module.parameters(recurse=False))]


def scored_layers(
    model: nn.Module, include_embedding: bool = False, include_head: bool = False, exclude: tuple[str, ...] = ()
) -> list[tuple[str, nn.Module]]:
    """Every linear layer (``nn.Linear``, transformers' ``Conv1D``; the output head only if asked) and, if
    asked, every ``nn.Embedding``, in registration order.

    The head is found structurally (:func:`selection_callbacks.nn.heads.output_heads`: marked,
    tied to the embedding, or the vocabulary-sized Linear). A weight tied across several modules (a
    head tied to the token embedding) is one parameter: when either flag asks for one of its
    modules, all of them are listed (:class:`GhostEngine` scores them as one), and ``exclude``
    must name all of them or none. A position table (an embedding looked up with ids broadcast
    over rows) cannot be captured per sample; the engine skips it and lists it in
    ``GhostScores.shared``. Modules with parameters of fewer than two dimensions (norm gains) or
    none (rotary embeddings) are not scored and need no hooks; any other module with a trainable
    ≥ 2-D parameter (:func:`unscorable_layers`) is an error unless ``exclude`` names it.
    """
    unscorable = [name for name in unscorable_layers(model) if name not in exclude]
    if unscorable:
        module = model.get_submodule(unscorable[0])
        shapes = {n: tuple(p.shape) for n, p in module.named_parameters(recurse=False) if p.ndim >= 2}
        raise TypeError(
            f"ghost scoring has no per-sample gradient form for layer {unscorable[0]!r} ({type(module).__name__}, "
            f"parameters {shapes}; {len(unscorable)} such layer(s): {unscorable[:4]}): it scores nn.Linear, "
            "transformers Conv1D and nn.Embedding weights. Leave the layer out with layers=[...] (OPUS/GREATS: "
            "glob patterns of the layers to score, which it must not match) or exclude=(...) (GhostEngine), "
            "or freeze its parameters"
        )
    heads = output_heads(model)
    candidates, wanted = [], set()
    for name, module in model.named_modules():
        if linear_kind(module) is not None:
            asked = include_head or name not in heads
        elif isinstance(module, nn.Embedding):
            asked = include_embedding
        else:
            continue
        candidates.append((name, module))
        if asked and name not in exclude:
            wanted.add(id(module.weight))
    out = [(name, m) for name, m in candidates if id(m.weight) in wanted]
    for names in tied_weights(out):
        if any(n in exclude for n in names):
            raise ValueError(f"layers {list(names)} share one weight (tied): exclude all of them or none, got exclude={list(exclude)}")
    if not out:
        raise ValueError(f"{type(model).__name__} has no linear layers (nn.Linear, Conv1D) to score")
    return out


def tied_weights(layers: list[tuple[str, nn.Module]]) -> list[tuple[str, ...]]:
    """Names of the layers that share one weight, per shared weight (in layer order; unshared weights left out)."""
    uses: dict[int, list[str]] = {}
    for name, module in layers:
        uses.setdefault(id(module.weight), []).append(name)
    return [tuple(names) for names in uses.values() if len(names) > 1]


def registered_parameters(model: nn.Module, layers: list[tuple[str, nn.Module]]) -> dict[str, dict[str, nn.Parameter]]:
    """Each layer's own parameters by name (``"weight"``, ``"bias"``) as the optimizer holds them.

    On an eager or DDP model these are ``module.weight`` and ``module.bias``. Under FSDP2 (``fully_shard``) the
    optimizer holds the sharded ``DTensor`` parameters (global shapes, row shards), which FSDP2 registers on the
    modules outside a forward and backward only: inside them a unit's modules hold unsharded plain copies, and a
    root unit stays unsharded after a forward without a backward (validation). So this calls
    ``FSDPModule.reshard()`` on every FSDP2 unit of ``model`` first (a no-op where the shards are registered;
    else it frees the unsharded copies, which the unit's next forward all-gathers again, as every forward does
    after a backward), then reads the registered parameters. Call it outside a forward and backward.

    Example::

        params = registered_parameters(model, scored_layers(model))
        optimizer.state[params["blocks.0.attn.qkv"]["weight"]]  # found under FSDP2 too
    """
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
    return {name: dict(module.named_parameters(recurse=False)) for name, module in layers}
