"""Where a scoring call gets its maps: the live optimizer's (OPUS), plain gradients, or GREATS' SGD step."""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from selection_callbacks.nn.optim import MuonWithAdamW
from selection_callbacks.scoring.maps.base import MAP_BUILDERS, OptimizerMap, per_layer
from selection_callbacks.scoring.maps.sgd import ScalarMap


def supported() -> str:
    """The optimizer classes with a registered map (torch's by their public path), and the composite."""
    names = [f"torch.optim.{c.__name__}" if getattr(torch.optim, c.__name__, None) is c else f"{c.__module__}.{c.__qualname__}"
             for c in MAP_BUILDERS]
    return ", ".join([*names, "selection_callbacks.nn.optim.MuonWithAdamW"])


class OptimizerStepMaps:
    """The live optimizer's maps (per step: the state moves), built by the optimizer class's registered builder
    (:func:`~selection_callbacks.scoring.maps.base.register_map`); the composite ``MuonWithAdamW`` gives each
    parameter its inner optimizer's map.

    Example::

        maps = OptimizerStepMaps(trainer.optimizers[0])
        scores = engine.score(loss_fn, rows, n_candidates, maps)

    Args:
        optimizer: SGD, AdamW, Muon (or any registered class) or the Muon+AdamW composite.

    Raises:
        TypeError: an optimizer (or an inner one) whose class has no registered map.
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        inner = optimizer.optimizers if isinstance(optimizer, MuonWithAdamW) else (optimizer,)
        for opt in inner:
            if type(opt) not in MAP_BUILDERS:
                raise TypeError(f"no optimizer map for {type(opt).__name__}; supported: {supported()}")
        self._where: dict[int, tuple[torch.optim.Optimizer, dict]] = {
            id(p): (opt, g) for opt in inner for g in opt.param_groups for p in g["params"]
        }

    def group_key(self, param: torch.nn.Parameter) -> Hashable:
        """The parameter's optimizer group: one set of hyperparameters."""
        return id(self._locate(param)[1])

    def gains_from_grouping(self, param: torch.nn.Parameter) -> bool:
        """Muon's maps: one eigendecomposition batch and one scalar recursion per group; the elementwise maps gain
        nothing and would hold every grouped layer's captures."""
        return type(self._locate(param)[0]) is torch.optim.Muon

    def __call__(self, params: Sequence[torch.nn.Parameter], gbar: torch.Tensor) -> OptimizerMap:
        """The grouped map for ``params`` (one optimizer group), ``gbar`` [L, *shape]."""
        opt, group = self._locate(params[0])
        if any(self._locate(p)[1] is not group for p in params[1:]):
            raise ValueError("grouped parameters must share one optimizer group (see group_key)")
        return MAP_BUILDERS[type(opt)](opt, group, params, gbar)

    def _locate(self, param: torch.nn.Parameter) -> tuple[torch.optim.Optimizer, dict]:
        if id(param) not in self._where:
            raise KeyError("a scored parameter is not in the optimizer")
        return self._where[id(param)]


class IdentityStepMaps:
    """P = c·I for every parameter: plain gradient geometry with step size c."""

    def __init__(self, c: float = 1.0) -> None:
        self.c = c

    def group_key(self, param: torch.nn.Parameter) -> Hashable:
        return None

    def gains_from_grouping(self, param: torch.nn.Parameter) -> bool:
        return False

    def __call__(self, params: Sequence[torch.nn.Parameter], gbar: torch.Tensor) -> OptimizerMap:
        return ScalarMap(self.c)


class SGDStepMaps:
    """P = η_p·I with η_p = lr of the parameter's group / ``batch``: GREATS' SGD step on the batch mean.

    Args:
        optimizer: any optimizer (only its per-group learning rates are read).
        batch: sequences the update averages over (W·K × gradient-accumulation steps: every rank's kept rows).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, batch: int) -> None:
        self._lr = {id(p): float(g["lr"]) for g in optimizer.param_groups for p in g["params"]}
        self.batch = batch

    def group_key(self, param: torch.nn.Parameter) -> Hashable:
        if id(param) not in self._lr:
            raise KeyError("a scored parameter is not in the optimizer")
        return None

    def gains_from_grouping(self, param: torch.nn.Parameter) -> bool:
        return False

    def __call__(self, params: Sequence[torch.nn.Parameter], gbar: torch.Tensor) -> OptimizerMap:
        return ScalarMap(per_layer([self._lr[id(p)] / self.batch for p in params], gbar.device))
