"""SGD's map: P g = c·g, a scalar per layer."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from selection_callbacks.scoring.maps.base import Scale, check_minimizes, lead, per_layer, register_map


class ScalarMap:
    """P g = c·g: SGD (c = lr, times (1 − dampening) once momentum is on)."""

    exact_factors = True

    def __init__(self, c: Scale) -> None:
        self.c = c

    def apply(self, g: torch.Tensor) -> torch.Tensor:
        return lead(self.c, g.ndim) * g

    def utility_vector(self, gbar: torch.Tensor) -> torch.Tensor:
        return self.apply(gbar)

    def token_factors(self, b: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return lead(self.c, b.ndim) * b, a

    def token_maps(self) -> tuple[Scale, None]:
        """(c as a number or [L, 1], None): token_factors(b, a) = (c·b, a)."""
        return lead(self.c, 2), None


@register_map(torch.optim.SGD)
def sgd_map(opt: torch.optim.Optimizer, group: dict, params: Sequence[torch.nn.Parameter], gbar: torch.Tensor) -> ScalarMap:
    """SGD's map of the grouped ``params`` of ``group``: c = lr (with momentum, Nesterov and dampening as torch's step).

    Raises:
        ValueError: ``maximize=True``.
    """
    check_minimizes(group, "SGD")
    mu, damp, nesterov = group["momentum"], group["dampening"], group["nesterov"]
    coefs = []
    for p in params:
        has_buf = opt.state.get(p, {}).get("momentum_buffer") is not None
        coef = 1.0 if mu == 0 or not has_buf else (1 - damp)
        coefs.append(float(group["lr"]) * ((1.0 + mu * coef) if nesterov else coef))
    return ScalarMap(per_layer(coefs, gbar.device))

