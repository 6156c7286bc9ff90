"""Optimizers for a language model: AdamW, or Muon on hidden matrices + AdamW on the rest as one object.

Which tensor goes where is one stated rule (:func:`param_split`), the same for this project's GPT and
Hugging Face causal LMs (Llama, Qwen2, GPT-2's ``Conv1D``); :meth:`ParamSplit.describe` lists its choices.
"""

from __future__ import annotations

import math
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from selection_callbacks.nn.heads import output_heads


class MuonWithAdamW(torch.optim.Optimizer):
    """``torch.optim.Muon`` for 2-D hidden matrices and ``torch.optim.AdamW`` for everything else.

    Lightning sees one optimizer, so automatic optimization, gradient accumulation and LR
    schedulers work unchanged: :attr:`param_groups` are the inner optimizers' own group dicts
    (a scheduler that sets ``lr`` reaches them), and :meth:`state_dict` nests both states.
    Each group carries ``"optimizer": "muon" | "adamw"``; :meth:`optimizer_for` resolves a
    parameter to the inner optimizer that updates it (for the optimizer maps).

    Example::

        opt = MuonWithAdamW(muon_groups=[{"params": hidden, "lr": 0.02}],
                            adamw_groups=[{"params": rest, "lr": 3e-3}])

    Args:
        muon_groups: param groups for Muon (2-D weights only).
        adamw_groups: param groups for AdamW.
        muon_kwargs: extra ``torch.optim.Muon`` arguments (momentum, nesterov, ...).
        adamw_kwargs: extra ``torch.optim.AdamW`` arguments (betas, eps, ...).
    """

    def __init__(
        self,
        muon_groups: list[dict[str, Any]],
        adamw_groups: list[dict[str, Any]],
        muon_kwargs: dict[str, Any] | None = None,
        adamw_kwargs: dict[str, Any] | None = None,
    ) -> None:
        for g in muon_groups:
            g["optimizer"] = "muon"
        for g in adamw_groups:
            g["optimizer"] = "adamw"
        self.muon = torch.optim.Muon(muon_groups, **(muon_kwargs or {}))
        self.adamw = torch.optim.AdamW(adamw_groups, **(adamw_kwargs or {}))
        super().__init__(self.muon.param_groups + self.adamw.param_groups, defaults={})

    @property
    def optimizers(self) -> tuple[torch.optim.Optimizer, torch.optim.Optimizer]:
        return self.muon, self.adamw

    @property
    def state(self) -> dict:  # type: ignore[override]
        """Merged view of both inner states (per-parameter dicts are shared, not copied)."""
        return {**self.muon.state, **self.adamw.state}

    @state.setter
    def state(self, value: Any) -> None:
        """The base class assigns an empty state; the inner optimizers own the real one."""

    def optimizer_for(self, param: torch.Tensor) -> torch.optim.Optimizer:
        """The inner optimizer that updates ``param``."""
        for opt in self.optimizers:
            if any(p is param for g in opt.param_groups for p in g["params"]):
                return opt
        raise KeyError("parameter is not managed by this optimizer")

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.muon.step()
        self.adamw.step()
        return loss

    def state_dict(self) -> dict[str, Any]:
        return {"muon": self.muon.state_dict(), "adamw": self.adamw.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if set(state_dict) != {"muon", "adamw"}:
            raise ValueError(f"expected a MuonWithAdamW state with keys muon/adamw, got {sorted(state_dict)}")
        self.muon.load_state_dict(state_dict["muon"])
        self.adamw.load_state_dict(state_dict["adamw"])
        # torch rebuilds the group dicts on load: point ours (and any scheduler) at the new ones
        self.param_groups = self.muon.param_groups + self.adamw.param_groups


# The split rule, applied to each trainable tensor once, in registration order (a tensor reached under
# several names, as a tied head is, is listed under its first name: the embedding's):
#
# 1. 0-D and 1-D tensors (norm gains, biases) → ``flat``: AdamW without weight decay.
# 2. the weights of ``nn.Embedding`` modules (token and position tables) → ``other2d``: AdamW with decay.
# 3. the weights of the output head (:func:`~selection_callbacks.nn.heads.output_heads`) → ``other2d``.
# 4. any other tensor of more than two dimensions (stacked expert weights) → ``other2d``: Muon takes matrices.
# 5. every other 2-D tensor is a hidden matrix → ``hidden``: Muon under ``"muon"``, AdamW with decay under
#    ``"adamw"``. A hidden matrix of a transformers ``Conv1D`` (GPT-2) is stored [in, out], the transpose of
#    ``nn.Linear``'s [out, in]; it is ``transposed`` (see :func:`build_optimizer` for what Muon does with it).
_RULES = {
    "hidden": "hidden 2-D matrices",
    "other2d": "embeddings, output head, >2-D weights",
    "flat": "norms and biases (<2-D)",
}


@dataclass(frozen=True)
class ParamSplit:
    """Where the split rule puts each trainable tensor, by its ``named_parameters`` name.

    Attributes:
        hidden: hidden 2-D matrices.
        other2d: embeddings (token and position), the output head, and weights of more than two dimensions.
        flat: tensors of fewer than two dimensions: norm gains and biases.
        transposed: names of the hidden matrices stored [in, out] (transformers' ``Conv1D``).
        tied: each further name of a tied tensor → the name it is listed under.
    """

    hidden: dict[str, nn.Parameter]
    other2d: dict[str, nn.Parameter]
    flat: dict[str, nn.Parameter]
    transposed: frozenset[str]
    tied: dict[str, str]

    def describe(self, optimizer: str) -> str:
        """A compact table of the rule's choices: per group the rule, tensor and element counts, and name patterns."""
        groups = {"hidden": "muon" if optimizer == "muon" else "adamw, decay", "other2d": "adamw, decay",
                  "flat": "adamw, no decay"}
        lines = [f"parameter split for optimizer={optimizer!r} (a tied tensor counted once):"]
        for key, where in groups.items():
            params: dict[str, nn.Parameter] = getattr(self, key)
            numel = sum(p.numel() for p in params.values())
            lines.append(f"  {where:<15} {_RULES[key]:<38} {len(params):>4} tensors {numel:>12,} elements  "
                         f"{_patterns(list(params))}")
        if self.tied:
            lines.append("  tied: " + ", ".join(f"{alias} is {name}" for alias, name in self.tied.items()))
        if self.transposed:
            step = "Muon lr ×√(out/in), as for [out, in]" if optimizer == "muon" else "AdamW is elementwise: as stored"
            lines.append(f"  stored [in, out] (Conv1D; {step}): {_patterns(sorted(self.transposed))}")
        return "\n".join(lines)


def param_split(model: nn.Module) -> ParamSplit:
    """The model's trainable tensors split by the rule above (frozen tensors are left out)."""
    groups: dict[str, dict[str, nn.Parameter]] = {"hidden": {}, "other2d": {}, "flat": {}}
    transposed, tied, first_name = set(), {}, {}
    heads = output_heads(model)
    conv1d = conv1d_type()
    for module_name, module in model.named_modules(remove_duplicate=False):
        for local, p in module.named_parameters(recurse=False):
            name = f"{module_name}.{local}" if module_name else local
            if not p.requires_grad:
                continue
            if id(p) in first_name:
                tied[name] = first_name[id(p)]
                continue
            first_name[id(p)] = name
            if p.ndim < 2:
                groups["flat"][name] = p
            elif isinstance(module, nn.Embedding) or module_name in heads or p.ndim > 2:
                groups["other2d"][name] = p
            else:
                groups["hidden"][name] = p
                if conv1d is not None and isinstance(module, conv1d):
                    transposed.add(name)
    return ParamSplit(**groups, transposed=frozenset(transposed), tied=tied)


def split_params(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter], list[nn.Parameter]]:
    """(hidden 2-D matrices, embeddings/head/>2-D weights, norms and biases) by the rule of :func:`param_split`."""
    split = param_split(model)
    return list(split.hidden.values()), list(split.other2d.values()), list(split.flat.values())


def build_optimizer(
    model: nn.Module,
    name: str,
    lr: float,
    weight_decay: float,
    betas: tuple[float, float],
    muon_lr: float,
    muon_momentum: float,
    muon_weight_decay: float,
) -> torch.optim.Optimizer:
    """AdamW over everything (decay on ≥2-D weights), or Muon on hidden 2-D matrices + AdamW on the rest.

    A hidden matrix stored [in, out] (``Conv1D``) is orthogonalised as stored: Newton–Schulz commutes with
    the transpose, NS(Gᵀ) = NS(G)ᵀ. torch's Muon scales each step by √max(1, rows/cols) of the *stored*
    shape, which for [in, out] would be √max(1, in/out) instead of a Linear's √max(1, out/in); such a
    matrix therefore sits in a Muon group with lr × √(out/in) and weight decay ÷ √(out/in), so its update
    and decay equal those of the same layer as an ``nn.Linear``.
    """
    split = param_split(model)
    hidden, other2d, flat = list(split.hidden.values()), list(split.other2d.values()), list(split.flat.values())
    if name == "adamw":
        groups = [{"params": hidden + other2d, "weight_decay": weight_decay}, {"params": flat, "weight_decay": 0.0}]
        return torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, betas=betas)
    if name == "muon":
        by_ratio: dict[float, list[nn.Parameter]] = {}
        for pname, p in split.hidden.items():
            ratio = math.sqrt(p.shape[1] / p.shape[0]) if pname in split.transposed else 1.0
            by_ratio.setdefault(ratio, []).append(p)
        muon_groups = [{"params": by_ratio.pop(1.0, [])}]
        muon_groups += [{"params": ps, "lr": muon_lr * r, "weight_decay": muon_weight_decay / r}
                        for r, ps in sorted(by_ratio.items())]
        adamw_groups = [{"params": other2d, "weight_decay": weight_decay}, {"params": flat, "weight_decay": 0.0}]
        return MuonWithAdamW(
            muon_groups=[g for g in muon_groups if g["params"]],
            adamw_groups=[g for g in adamw_groups if g["params"]],
            muon_kwargs={"lr": muon_lr, "momentum": muon_momentum, "weight_decay": muon_weight_decay},
            adamw_kwargs={"lr": lr, "betas": betas},
        )
    raise ValueError(f"unknown optimizer {name!r}; choose 'adamw' or 'muon'")


def conv1d_type() -> type | None:
    """transformers' ``Conv1D`` (weight [in, out]) when transformers is loaded; a model holding one has loaded it."""
    module = sys.modules.get("transformers.pytorch_utils")
    return getattr(module, "Conv1D", None)


def _patterns(names: list[str], shown: int = 8) -> str:
    """Names with layer indices folded to ``*`` (``h.0.attn`` and ``h.1.attn`` → ``h.*.attn``), first ``shown`` kept."""
    folded = list(dict.fromkeys(re.sub(r"\.\d+(?=\.|$)", ".*", n) for n in names))
    more = f" (+{len(folded) - shown} more)" if len(folded) > shown else ""
    return ", ".join(folded[:shown]) + more if folded else "-"


def warmup_cosine(warmup_steps: int, total_steps: int, min_lr_ratio: float) -> Callable[[int], float]:
    """LR multiplier: linear warmup to 1 over ``warmup_steps``, cosine down to ``min_lr_ratio`` at ``total_steps``."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor

