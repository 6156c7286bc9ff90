"""Muon's map: the exact vector–Jacobian product of its Newton–Schulz iteration at the momentum, and the
frozen Newton–Schulz map for sketches.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.optim._muon import _adjust_lr

from selection_callbacks.scoring.maps.base import Scale, lead, register_map, rows_matmul


def wide_unit(x: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """(X₀, r, tall): x [..., m, n] in float32 in the wide orientation (xᵀ where m > n), divided by
    r = max(‖x‖_F, eps) [...], as Newton–Schulz starts (no device sync)."""
    tall = x.shape[-2] > x.shape[-1]
    X = (x.mT if tall else x).float()
    norm = torch.linalg.matrix_norm(X).clamp(min=eps)
    return X / norm[..., None, None], norm, tall


# eigenvalues of the unit-norm Gram matrix (they sum to 1) this close share the mean of their derivatives as
# their divided difference: the quotient's rounding (~1e-16·φ/gap) and the mean's truncation (~gap²·φ‴) both stay
# below 1e-10 of the entries on full-rank, rank-3 and decaying spectra
CLOSE_EIGENVALUES = 1e-9


@dataclass(frozen=True)
class SpectralNS:
    """Newton–Schulz at one point, in the eigenbasis of the point's Gram matrix.

    With X₀ = x/max(‖x‖_F, eps) wide (d×n, d ≤ n) and A₀ = X₀X₀ᵀ = QΛQᵀ, every iterate is
    X_k = L_k X₀ with L_k a polynomial in A₀: a step multiplies L by S = q(A) and A by S²,
    q(t) = a + bt + ct². On an eigenvalue λ that is s = q(λ⁽ᵏ⁾), φ⁽ᵏ⁺¹⁾ = sφ⁽ᵏ⁾, λ⁽ᵏ⁺¹⁾ = s²λ⁽ᵏ⁾ from
    φ⁽⁰⁾ = 1, λ⁽⁰⁾ = λ, so NS(x) = L X₀ with L = Q diag(φ) Qᵀ (transposed back where x is tall).
    ``Phi`` [..., d, d] holds φ's divided differences (φ(λ_i) − φ(λ_j))/(λ_i − λ_j), and
    (φ'(λ_i) + φ'(λ_j))/2 where |λ_i − λ_j| ≤ ``CLOSE_EIGENVALUES`` (φ'(λ_i) on the diagonal); φ and φ'
    come from the scalar recursion in float64. ``norm`` [...] is the clamped ‖x‖_F, ``clamped`` [...]
    where the clamp acted.
    """

    X0: torch.Tensor
    norm: torch.Tensor
    clamped: torch.Tensor
    tall: bool
    Q: torch.Tensor
    phi: torch.Tensor
    Phi: torch.Tensor

    @property
    def L(self) -> torch.Tensor:
        """L = Q diag(φ) Qᵀ [..., d, d], the left factor: NS(x) = L X₀ in the wide orientation."""
        return (self.Q * self.phi[..., None, :]) @ self.Q.mT


@dataclass(frozen=True)
class NewtonSchulz:
    """Torch's Muon orthogonalisation NS(x) as an out-of-place float32 function of stacks [..., m, n].

    The same steps as ``torch.optim._muon._zeropower_via_newtonschulz``: X₀ = x/max(‖x‖_F, eps) in
    the wide orientation (xᵀ where m > n), then ``steps`` times A = XXᵀ, X ← aX + (bA + cA²)X, the
    result transposed back. Torch iterates in bfloat16; this copy stays in float32. ``spectral``
    writes the same polynomial in the eigenbasis of X₀X₀ᵀ (``SpectralNS``), where ``spectral_vjp``
    differentiates it with about 6·d²n multiply-adds and one d×d eigendecomposition.
    """

    coefficients: tuple[float, float, float]
    steps: int
    eps: float

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        X, _, tall = wide_unit(x, self.eps)
        a, b, c = self.coefficients
        for _ in range(self.steps):
            A = X @ X.mT
            X = a * X + (b * A + c * (A @ A)) @ X
        return X.mT if tall else X

    def spectral(self, x: torch.Tensor) -> SpectralNS:
        """NS at x [..., m, n] in the eigenbasis of its Gram matrix: d²n multiply-adds for X₀X₀ᵀ, one float64
        eigendecomposition of d×d, O(d) a step and O(d²) for the divided differences."""
        X0, norm, tall = wide_unit(x, self.eps)
        clamped = norm <= self.eps
        X64 = X0.double()
        A = X64 @ X64.mT
        lam, Q = torch.linalg.eigh(A)
        a, b, c = self.coefficients
        phi, d_phi = torch.ones_like(lam), torch.zeros_like(lam)  # φ⁽ᵏ⁾(λ) and its derivative in λ
        lam_k, d_lam = lam, torch.ones_like(lam)  # λ⁽ᵏ⁾(λ) and its derivative
        for _ in range(self.steps):
            s, d_s = a + lam_k * (b + c * lam_k), (b + 2 * c * lam_k) * d_lam
            d_phi = d_s * phi + s * d_phi
            phi = s * phi
            d_lam = (2 * d_s * lam_k + s * d_lam) * s  # λ⁽ᵏ⁺¹⁾ = s²λ⁽ᵏ⁾
            lam_k = s * s * lam_k
        gap = lam[..., :, None] - lam[..., None, :]
        close = gap.abs() <= CLOSE_EIGENVALUES
        Phi = torch.where(close, (d_phi[..., :, None] + d_phi[..., None, :]) / 2,
                          (phi[..., :, None] - phi[..., None, :]) / gap.masked_fill(close, 1.0))
        return SpectralNS(X0, norm, clamped, tall, Q.float(), phi.float(), Phi.float())

    def vjp(self, x: torch.Tensor | SpectralNS, v: torch.Tensor) -> torch.Tensor:
        """(∂NS/∂x)ᵀ v at x, [..., m, n] → [..., m, n] float32: ``spectral_vjp`` on a CPU (or given a
        ``SpectralNS``), ``reverse_vjp`` on an accelerator, where an eigendecomposition is slow next to matrix
        products and synchronises the device."""
        if isinstance(x, torch.Tensor) and x.device.type != "cpu":
            return self.reverse_vjp(x, v)
        return self.spectral_vjp(x, v)

    def reverse_vjp(self, x: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """(∂NS/∂x)ᵀ v by reverse mode through the direct iteration: about 50·d²n + 20·d³ multiply-adds."""
        with torch.enable_grad():
            x = x.detach().float().requires_grad_(True)
            return torch.autograd.grad(self(x), x, v.float())[0]

    def spectral_vjp(self, x: torch.Tensor | SpectralNS, v: torch.Tensor) -> torch.Tensor:
        """(∂NS/∂x)ᵀ v at x (or at the point of a ``SpectralNS``), [..., m, n] → [..., m, n] float32.

        NS = L X₀ sends V back as X̄₀ = LV + 2 sym(Ā)X₀ with Ā the pull-back of L̄ = VX₀ᵀ through
        L = φ(A₀): by Daleckii–Krein, sym(Ā) = Q(Φ ∘ sym(QᵀL̄Q))Qᵀ. With W = QᵀV and Z = QᵀX₀ that is
        X̄₀ = Q(φ ⊙ W + 2(Φ ∘ sym(WZᵀ))Z), five d²n products; X₀ = x/r then sends X̄₀ back as
        (X̄₀ − X₀⟨X₀, X̄₀⟩)/r (X̄₀/eps where r is clamped).
        """
        ns = x if isinstance(x, SpectralNS) else self.spectral(x)
        V = (v.mT if ns.tall else v).float()
        W, Z = ns.Q.mT @ V, ns.Q.mT @ ns.X0
        M = W @ Z.mT
        sym2 = ns.Phi * (M + M.mT)  # 2 Φ ∘ sym(WZᵀ)
        X_bar = ns.Q @ (ns.phi[..., :, None] * W + sym2 @ Z)
        radial = (ns.X0 * X_bar).sum((-2, -1), keepdim=True) * ~ns.clamped[..., None, None]
        G = (X_bar - ns.X0 * radial) / ns.norm[..., None, None]
        return G.mT if ns.tall else G


class MuonMap:
    """Muon's step: the frozen map P for sketches, and the exact vector–Jacobian product for utilities.

    Torch's Muon at the next step updates buf' = μ·buf + (1−μ)·g and orthogonalises
    U(g) = μ²·buf + (1−μ²)·g with Nesterov (U = buf' without: μ·buf + (1−μ)·g), then moves
    θ by −lr_adj·NS(U) (decoupled decay apart, which does not depend on g). So
    J = −lr_adj·coef·∂NS/∂U with coef = 1 − μ² (Nesterov) or 1 − μ, and ``utility_vector`` is
    lr_adj·coef·(∂NS/∂U)ᵀ ḡ at the evaluation point U(0) = μ²·buf (μ·buf without Nesterov), the fresh
    gradient's share taken to zero: the momentum torch's step will orthogonalise. At a layer's first step the
    momentum is zero and the point is coef·ḡ, the update torch would take on the target gradient (NS has no
    derivative at 0).

    ``apply`` and ``token_factors`` are the frozen map the sketches use: Newton–Schulz at the same point
    ū is NS(ū) = L X₀ with X₀ = ū/r wide, r = ‖ū‖_F, and L symmetric (``SpectralNS.L`` on a CPU,
    :func:`newton_schulz_left_factor` elsewhere: one eigendecomposition serves the map and the VJP).
    Holding L fixed, coef·g maps to lr_adj·coef/r · L g (``scale`` [L] or a number, ``L`` [L, d, d]).
    ``point`` is ū [L, m, n], or its ``SpectralNS`` on a CPU.
    """

    exact_factors = True

    def __init__(
        self, scale: Scale, L: torch.Tensor, tall: bool, point: torch.Tensor | SpectralNS, step: Scale, ns: NewtonSchulz
    ) -> None:
        self.scale, self.L, self.tall = scale, L, tall
        self.point, self.step, self.ns = point, step, ns

    def apply(self, g: torch.Tensor) -> torch.Tensor:
        # L is symmetric: L g = (gᵀ L)ᵀ
        Lg = rows_matmul(g, self.L) if self.tall else rows_matmul(g.mT, self.L).mT
        return lead(self.scale, g.ndim) * Lg

    def utility_vector(self, gbar: torch.Tensor) -> torch.Tensor:
        """lr_adj·coef·(∂NS/∂U)ᵀ ḡ at U = ``point``, [L, m, n]."""
        return lead(self.step, gbar.ndim) * self.ns.vjp(self.point, gbar)

    def token_factors(self, b: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.tall:
            return lead(self.scale, b.ndim) * b, rows_matmul(a, self.L)
        return lead(self.scale, b.ndim) * rows_matmul(b, self.L), a

    def token_maps(self) -> tuple[Scale, torch.Tensor | None]:
        """token_factors(b, a) as (scale·L [L, d, d], None), or (scale [L, 1] or a number, L) where the weight is
        tall: the matrices send a factor x to x L, so a sketch folds them into its own dense rows."""
        if self.tall:
            return lead(self.scale, 2), self.L
        return lead(self.scale, 3) * self.L, None


def newton_schulz_left_factor(
    u: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float
) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """(L, ‖u‖_F, tall): NS(u) = L·(u/‖u‖) in the wide orientation, computed in float32.

    ``u`` is one matrix [m, n] or a group [L, m, n] (then L [L, d, d] and norms [L]).
    Iterates on d×d matrices only (d the short side): with X_k = L_k X₀ and L_k a polynomial in
    A₀ = X₀X₀ᵀ (so they commute), A_k = X_k X_kᵀ = L_k² A₀ and each step S = aI + bA_k + cA_k²
    gives L ← S L, A ← S² A_k: four d×d products a step instead of two d×n ones and two d×d.
    """
    single = u.ndim == 2
    x, norm, tall = wide_unit(u[None] if single else u, eps)
    a, b, c = coefficients
    eye = torch.eye(x.shape[1], device=x.device, dtype=x.dtype).expand(x.shape[0], -1, -1)
    a_eye = a * eye
    A = x @ x.mT
    L = eye
    for step in range(steps):
        S = torch.baddbmm(torch.add(a_eye, A, alpha=b), A, A, alpha=c)
        L = S @ L
        if step < steps - 1:  # the last step's A would not be read
            A = S @ (S @ A)
    L = (L + L.mT) / 2  # L is symmetric in exact arithmetic; keep it so in float32
    return (L[0], norm[0], tall) if single else (L, norm, tall)


@register_map(torch.optim.Muon)
def muon_map(opt: torch.optim.Optimizer, group: dict, params: Sequence[torch.nn.Parameter], gbar: torch.Tensor) -> MuonMap:
    """Muon's map of the grouped ``params`` of ``group`` at the momentum (:class:`MuonMap`)."""
    mu, nesterov = group["momentum"], group["nesterov"]
    bufs = [opt.state.get(p, {}).get("momentum_buffer") for p in params]
    coef = (1 - mu * mu) if nesterov else (1 - mu)
    carry = mu * mu if nesterov else mu
    ns = NewtonSchulz(tuple(group["ns_coefficients"]), group["ns_steps"], group["eps"])
    lr = _adjust_lr(float(group["lr"]), group["adjust_lr_fn"], params[0].shape)
    # the momentum's share U(0), or before the first step the target gradient's update
    ref = torch.stack([coef * g.float() if buf is None else carry * buf.float() for g, buf in zip(gbar, bufs)])
    if ref.device.type == "cpu":  # one eigendecomposition gives the left factor and the VJP
        at_ref = ns.spectral(ref)
        return MuonMap(lr * coef / at_ref.norm, at_ref.L, at_ref.tall, at_ref, lr * coef, ns)
    # accelerators stay in matrix products (NewtonSchulz.vjp)
    L, norm, tall = newton_schulz_left_factor(ref, ns.coefficients, ns.steps, ns.eps)
    return MuonMap(lr * coef / norm, L, tall, ref, lr * coef, ns)

