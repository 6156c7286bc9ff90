"""Optimizers for the GPT: AdamW, or Muon on hidden matrices + AdamW on the rest as one object."""

from __future__ import annotations

import math
from collections.abc import Callable
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
    parameter to the inner optimizer that updates it (for preconditioners).

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


def split_params(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter], list[nn.Parameter]]:
    """(hidden 2-D matrices, other 2-D weights: embeddings and head, 1-D: norms and biases).

    The head is found by :func:`~selection_callbacks.nn.heads.output_heads`; a tied head shares
    the embedding's parameter, which is listed once.
    """
    hidden, other2d, flat = [], [], []
    heads, seen = output_heads(model), set()
    for module_name, module in model.named_modules():
        for name, p in module.named_parameters(recurse=False):
            if not p.requires_grad or id(p) in seen:
                continue
            seen.add(id(p))
            if p.ndim < 2:
                flat.append(p)
            elif isinstance(module, nn.Embedding) or module_name in heads:
                other2d.append(p)
            else:
                hidden.append(p)
    return hidden, other2d, flat


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
    """AdamW over everything (decay on 2-D weights), or Muon on hidden 2-D matrices + AdamW on the rest."""
    hidden, other2d, flat = split_params(model)
    if name == "adamw":
        groups = [{"params": hidden + other2d, "weight_decay": weight_decay}, {"params": flat, "weight_decay": 0.0}]
        return torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, betas=betas)
    if name == "muon":
        adamw_groups = [{"params": other2d, "weight_decay": weight_decay}, {"params": flat, "weight_decay": 0.0}]
        return MuonWithAdamW(
            muon_groups=[{"params": hidden}],
            adamw_groups=[g for g in adamw_groups if g["params"]],
            muon_kwargs={"lr": muon_lr, "momentum": muon_momentum, "weight_decay": muon_weight_decay},
            adamw_kwargs={"lr": lr, "betas": betas},
        )
    raise ValueError(f"unknown optimizer {name!r}; choose 'adamw' or 'muon'")


def warmup_cosine(warmup_steps: int, total_steps: int, min_lr_ratio: float) -> Callable[[int], float]:
    """LR multiplier: linear warmup to 1 over ``warmup_steps``, cosine down to ``min_lr_ratio`` at ``total_steps``."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor

