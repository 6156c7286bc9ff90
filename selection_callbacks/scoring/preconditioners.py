"""Frozen-operator surrogates P of one optimizer step, read from the live optimizer.

The update a fresh gradient g causes is Δθ = −P g (to first order, optimizer state held fixed);
OPUS/GREATS utilities are ⟨P G_i, ḡ⟩. Every map here is self-adjoint, so ⟨P G, ḡ⟩ = ⟨G, P ḡ⟩
and ``apply`` serves both sides. ``token_factors`` maps one rank-1 token term b aᵀ to
P(b aᵀ) = b' a'ᵀ (exact for scalar and Muon maps; for AdamW only after the rank-1
factorisation D ≈ r cᵀ, whose relative error ``factor_error`` reports).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Protocol

import torch
from torch.optim._muon import _adjust_lr

from models.optim import MuonWithAdamW


class Preconditioner(Protocol):
    exact_factors: bool

    def apply(self, g: torch.Tensor) -> torch.Tensor:
        """P g for a gradient of the parameter's shape."""
        ...

    def token_factors(self, b: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(b', a') with P(b aᵀ) = b' a'ᵀ per token; b [..., d_out], a [..., d_in]."""
        ...


class ScalarMap:
    """P g = c·g: SGD (c = lr, times (1 − dampening) once momentum is on)."""

    exact_factors = True

    def __init__(self, c: float) -> None:
        self.c = c

    def apply(self, g: torch.Tensor) -> torch.Tensor:
        return self.c * g

    def token_factors(self, b: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.c * b, a

    def token_scales(self) -> tuple[float, None]:
        """(c, None): token_factors(b, a) = (c·b, a)."""
        return self.c, None


TENSOR_FLOOR = 1e-2
POWER_ITERATIONS = 2  # the rank-1 error after 2 iterations equals that after 30 to 4 digits on trained GPT layers


class DiagonalMap:
    """P g = C·(D ⊙ g): AdamW with the second moment frozen.

    Torch's AdamW at step s+1 moves θ by −lr/(1−β1^(s+1)) · m/(√v/√(1−β2^(s+1)) + ε); the part
    linear in the fresh g gives C = lr(1−β1)√(1−β2^(s+1))/(1−β1^(s+1)) and
    D = 1/(√(β2 v) + ε√(1−β2^(s+1))). Where v has not formed (before the first step, or
    embedding rows never seen) D would explode; there β2·v is floored at (1−β2)·ḡ², the fresh
    gradient's own share of the next v estimated by the proxy gradient (at step 0 this makes
    C·D = lr/(|ḡ| + ε), Adam's first, normalised step), and, for entries the proxy does not
    touch either, at ``TENSOR_FLOOR`` times the tensor's mean.
    """

    exact_factors = False

    def __init__(self, C: float, D: torch.Tensor) -> None:
        self.C, self.D = C, D
        self._factors: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def factor_error(self) -> torch.Tensor:
        """‖D − r cᵀ‖_F / ‖D‖_F of the rank-1 factorisation (a 0-dim tensor: no device sync).

        The power iteration ends with c = Dᵀr/‖r‖², so rᵀD c = ‖r‖²‖c‖² and
        ‖D − r cᵀ‖² = ‖D‖² − ‖r‖²‖c‖²: no outer product, no further pass over D but its norm.
        """
        r, c = self.rank1()
        if c.numel() == 0:
            return torch.zeros((), device=self.D.device)
        sq = torch.linalg.vector_norm(self.D).square()
        return ((sq - r.dot(r) * c.dot(c)).clamp(min=0) / sq).sqrt()

    def apply(self, g: torch.Tensor) -> torch.Tensor:
        return (self.D * g).mul_(self.C)

    def rank1(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Best rank-1 r cᵀ ≈ D (power iteration on the positive matrix D)."""
        if self._factors is None:
            D = self.D
            if D.ndim == 1:
                self._factors = (D, torch.ones(0, device=D.device))
                return self._factors
            c = D.mean(0)
            for _ in range(POWER_ITERATIONS):
                r = D @ c / c.dot(c)
                c = D.T @ r / r.dot(r)
            self._factors = (r, c)
        return self._factors

    def token_factors(self, b: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scale_b, scale_a = self.token_scales()
        return scale_b * b, scale_a * a

    def token_scales(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(C·r, c): token_factors(b, a) = (C·r ⊙ b, c ⊙ a), for sketches that fold the scales in."""
        r, c = self.rank1()
        return self.C * r, c


class MuonMap:
    """P G = s·M G (wide/square weights) or s·G M (tall), Muon's update frozen at the reference ū.

    The Newton–Schulz steps X ← aX + (bA + cA²)X, A = XXᵀ, started at X₀ = ū/‖ū‖_F in the wide
    orientation, each multiply X on the left by a polynomial of X₀X₀ᵀ; their product L is
    symmetric and NS(ū) = L X₀. Holding L fixed, the fresh gradient's share of the update,
    coef·g (coef = 1 − μ² with Nesterov, 1 − μ without), maps to lr_adj·coef/‖ū‖_F · L g.
    """

    exact_factors = True

    def __init__(self, scale: float | torch.Tensor, L: torch.Tensor, tall: bool) -> None:
        self.scale, self.L, self.tall = scale, L, tall

    def apply(self, g: torch.Tensor) -> torch.Tensor:
        return self.scale * (g @ self.L if self.tall else self.L @ g)

    def token_factors(self, b: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.tall:
            return self.scale * b, a @ self.L
        return self.scale * (b @ self.L), a


def newton_schulz_left_factor(
    u: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float
) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """(L, ‖u‖_F, tall): NS(u) = L·(u/‖u‖) in the wide orientation, computed in float32.

    Iterates on d×d matrices only (d the short side): with X_k = L_k X₀ and L_k a polynomial in
    A₀ = X₀X₀ᵀ (so they commute), A_k = X_k X_kᵀ = L_k² A₀ and each step S = aI + bA_k + cA_k²
    gives L ← S L, A ← S² A_k: four d×d products a step instead of two d×n ones and two d×d.
    """
    tall = u.shape[0] > u.shape[1]
    x = (u.T if tall else u).float()
    norm = x.norm().clamp(min=eps)  # a 0-dim tensor: no device sync
    x = x / norm
    a, b, c = coefficients
    eye = torch.eye(x.shape[0], device=x.device, dtype=x.dtype)
    A = x @ x.T
    L = eye
    for step in range(steps):
        S = torch.addmm(a * eye + b * A, A, A, alpha=c)
        L = S @ L
        if step < steps - 1:  # the last step's A would not be read
            A = S @ (S @ A)
    return (L + L.T) / 2, norm, tall  # L is symmetric in exact arithmetic; keep it so in float32


def _adamw_map(opt: torch.optim.Optimizer, group: dict, p: torch.nn.Parameter, gbar: torch.Tensor) -> DiagonalMap:
    if group.get("maximize", False):
        raise ValueError("AdamW with maximize=True is not supported by the ghost preconditioner")
    beta1, beta2 = group["betas"]
    lr, eps = float(group["lr"]), group["eps"]
    state = opt.state.get(p, {})
    s = int(state["step"]) if "step" in state else 0
    v = state["exp_avg_sq"].float() if "exp_avg_sq" in state else torch.zeros_like(gbar, dtype=torch.float32)
    if group.get("amsgrad", False) and "max_exp_avg_sq" in state:
        v = torch.maximum(state["max_exp_avg_sq"].float() / beta2, v)
    bc2 = 1.0 - beta2 ** (s + 1)
    v_next = gbar.float().square().mul_(1 - beta2)
    torch.maximum(v_next, v * beta2, out=v_next)  # (1 − β2)ḡ² floors β2·v where v has not formed yet
    v_next.clamp_(min=TENSOR_FLOOR * v_next.mean())  # rows neither trained nor in the proxy
    C = lr * (1 - beta1) * math.sqrt(bc2) / (1 - beta1 ** (s + 1))
    return DiagonalMap(C, v_next.sqrt_().add_(eps * math.sqrt(bc2)).reciprocal_())


def _muon_map(opt: torch.optim.Optimizer, group: dict, p: torch.nn.Parameter, gbar: torch.Tensor) -> MuonMap:
    mu, nesterov = group["momentum"], group["nesterov"]
    buf = opt.state.get(p, {}).get("momentum_buffer")
    coef = (1 - mu * mu) if nesterov else (1 - mu)
    # reference update without the candidate: the momentum's share, or before the first step the proxy's
    ref = coef * gbar if buf is None else (mu * mu if nesterov else mu) * buf
    L, norm, tall = newton_schulz_left_factor(ref, group["ns_coefficients"], group["ns_steps"], group["eps"])
    lr = _adjust_lr(float(group["lr"]), group["adjust_lr_fn"], p.shape)
    return MuonMap(lr * coef / norm, L, tall)


def _sgd_map(opt: torch.optim.Optimizer, group: dict, p: torch.nn.Parameter, gbar: torch.Tensor) -> ScalarMap:
    if group.get("maximize", False):
        raise ValueError("SGD with maximize=True is not supported by the ghost preconditioner")
    mu, damp, nesterov = group["momentum"], group["dampening"], group["nesterov"]
    has_buf = opt.state.get(p, {}).get("momentum_buffer") is not None
    coef = 1.0 if mu == 0 or not has_buf else (1 - damp)
    if nesterov:
        coef = 1.0 + mu * coef
    return ScalarMap(float(group["lr"]) * coef)


_MAPS: dict[type, Callable] = {torch.optim.SGD: _sgd_map, torch.optim.AdamW: _adamw_map, torch.optim.Muon: _muon_map}
SUPPORTED = "torch.optim.SGD, torch.optim.AdamW, torch.optim.Muon, models.optim.MuonWithAdamW"


class OptimizerPreconditioner:
    """Resolves each parameter to its map from the live optimizer (per step: the state moves).

    Args:
        optimizer: SGD, AdamW, Muon or the Muon+AdamW composite; anything else is an error.
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        inner = optimizer.optimizers if isinstance(optimizer, MuonWithAdamW) else (optimizer,)
        for opt in inner:
            if type(opt) not in _MAPS:
                raise TypeError(f"no ghost preconditioner for {type(opt).__name__}; supported: {SUPPORTED}")
        self._where: dict[int, tuple[torch.optim.Optimizer, dict]] = {
            id(p): (opt, g) for opt in inner for g in opt.param_groups for p in g["params"]
        }

    def __call__(self, param: torch.nn.Parameter, gbar: torch.Tensor) -> Preconditioner:
        """The map for ``param`` (``gbar``, the proxy gradient, stands in for missing state)."""
        if id(param) not in self._where:
            raise KeyError("a scored parameter is not in the optimizer")
        opt, group = self._where[id(param)]
        return _MAPS[type(opt)](opt, group, param, gbar)


class IdentityPreconditioner:
    """P = c·I for every parameter: plain gradient geometry with step size c."""

    def __init__(self, c: float = 1.0) -> None:
        self.c = c

    def __call__(self, param: torch.nn.Parameter, gbar: torch.Tensor) -> Preconditioner:
        return ScalarMap(self.c)


class SGDStepPreconditioner:
    """P = η_p·I with η_p = lr of the parameter's group / ``batch``: GREATS' SGD step on the batch mean.

    Args:
        optimizer: any optimizer (only its per-group learning rates are read).
        batch: sequences the update averages over (K × gradient-accumulation steps).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, batch: int) -> None:
        self._lr = {id(p): float(g["lr"]) for g in optimizer.param_groups for p in g["params"]}
        self.batch = batch

    def __call__(self, param: torch.nn.Parameter, gbar: torch.Tensor) -> Preconditioner:
        if id(param) not in self._lr:
            raise KeyError("a scored parameter is not in the optimizer")
        return ScalarMap(self._lr[id(param)] / self.batch)
