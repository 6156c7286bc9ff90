"""Linear surrogates of one optimizer step, read from the live optimizer.

Write the step torch takes on a fresh gradient g as Δθ(g). A candidate's utility is the first-order
decrease of the proxy loss its gradient causes through that step, u_i = −⟨J G_i, ḡ⟩ = ⟨G_i, −Jᵀḡ⟩ with
J = ∂Δθ/∂g at the map's stated evaluation point: ``utility_vector(ḡ)`` = −Jᵀḡ. The redundancy
sketches use a frozen map P (Δθ ≈ −P g with the optimizer's state held fixed) through ``apply`` and
``token_factors``; for SGD and AdamW P = −J (diagonal, self-adjoint); for Muon P is Newton–Schulz
frozen at the reference update, and ``utility_vector`` is the exact vector–Jacobian product of the
iteration instead. ``token_factors`` maps one rank-1 token term b aᵀ to
P(b aᵀ) = b' a'ᵀ (exact for scalar and Muon maps; for AdamW only after the rank-1
factorisation D ≈ r cᵀ, whose errors ``factor_error`` and ``relative_factor_error`` report; the engine
sketches an AdamW layer through these factors only where the relative one is within its tolerance, and
otherwise forms P G_i exactly).

A map covers L parameters of one shape stacked (the engine scores same-shaped layers together, so
a GPU sees one kernel per group instead of one per layer): its tensors carry a leading layer
dimension, and every method takes tensors [L, ..., *shape] with any number of middle dimensions.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch.optim._muon import _adjust_lr

from selection_callbacks.nn.optim import MuonWithAdamW

Scale = float | torch.Tensor  # a Python number shared by the L layers, or a [L] tensor


class Preconditioner(Protocol):
    exact_factors: bool

    def apply(self, g: torch.Tensor) -> torch.Tensor:
        """P g for gradients [L, ..., *shape]."""
        ...

    def utility_vector(self, gbar: torch.Tensor) -> torch.Tensor:
        """−Jᵀ ḡ [L, *shape] for proxy gradients ``gbar`` [L, *shape]: u_i = ⟨G_i, −Jᵀḡ⟩."""
        ...

    def token_factors(self, b: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(b', a') with P(b aᵀ) = b' a'ᵀ per token; b [L, ..., d_out], a [L, ..., d_in]."""
        ...


def lead(x: Scale, ndim: int) -> Scale:
    """A per-layer tensor [L, *rest] viewed as [L, 1, ..., 1, *rest] with ``ndim`` dims (numbers pass)."""
    if not isinstance(x, torch.Tensor) or x.ndim == 0:
        return x
    return x.reshape(x.shape[0], *([1] * (ndim - x.ndim)), *x.shape[1:])


def rows_matmul(x: torch.Tensor, M: torch.Tensor) -> torch.Tensor:
    """x [L, ..., k] @ M [L, k, j] → [L, ..., j] as one batched product over the flattened rows.

    A broadcasting ``x @ M[:, None]`` would make ``matmul`` materialise M once per middle index.
    """
    return (x.reshape(x.shape[0], -1, x.shape[-1]) @ M).reshape(*x.shape[:-1], M.shape[-1])


def per_layer(values: Sequence[float], device: torch.device) -> Scale:
    """One Python number when the layers agree (no host→device copy, no sync), else a [L] tensor."""
    if all(v == values[0] for v in values):
        return float(values[0])
    return torch.tensor(values, dtype=torch.float32, device=device)


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


TENSOR_FLOOR = 1e-2
POWER_ITERATIONS = 2  # the rank-1 error after 2 iterations equals that after 30 to 4 digits on trained GPT layers


class DiagonalMap:
    """P g = C·(D ⊙ g): AdamW's step linearised in the fresh gradient; D [L, *shape], C a number or [L].

    Torch's AdamW at step s+1 moves θ by −lr/(1−β1^(s+1)) · m'/(√v'/√(1−β2^(s+1)) + ε) with
    m' = β1 m + (1−β1) g and v' = β2 v + (1−β2) g². Its derivative at g → 0 (moments frozen,
    ∂v'/∂g = 0 there) is diagonal: C = lr(1−β1)√(1−β2^(s+1))/(1−β1^(s+1)) and
    D = 1/(√(β2 x) + ε√(1−β2^(s+1))), P = −J, and ``utility_vector`` is ``apply``, with x = v, the
    derivative at g → 0. A layer whose v has not formed (every entry zero: before its first step) takes
    x = (1−β2)/β2·ḡ², the proxy gradient's share of the next v, instead, where the derivative (lr/ε) would not
    describe Adam's first, normalised step (C·D = lr/(|ḡ| + ε) there, Adam's first step on ḡ).

    x is floored at ``TENSOR_FLOOR`` times the layer's mean, for entries no step and no
    proxy row has touched (embedding rows never seen), where D would otherwise explode. The map
    stores C/√β2 and √β2·D (the same map, one pass fewer over every weight).
    """

    exact_factors = False

    def __init__(self, C: Scale, D: torch.Tensor) -> None:
        self.C, self.D = C, D
        self._factors: tuple[torch.Tensor, torch.Tensor] | None = None
        self._moments: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def factor_error(self) -> torch.Tensor:
        """[L] ‖D − κ r cᵀ‖_F / ‖D‖_F of the rescaled rank-1 map the factored sketch uses (no device sync).

        The power iteration ends with c = Dᵀr/‖r‖², so rᵀD c = ‖r‖²‖c‖² and
        ‖D − κ r cᵀ‖² = ‖D‖² − (2κ − κ²)‖r‖²‖c‖²: no outer product, no pass over D but its norm and κ's.
        """
        r, c = self.rank1()
        if c.shape[-1] == 0:
            return torch.zeros(self.D.shape[0], device=self.D.device)
        sq = torch.linalg.vector_norm(self.D.flatten(1), dim=1).square()
        k = self.norm_scale
        return ((sq - (2 * k - k * k) * r.square().sum(1) * c.square().sum(1)).clamp(min=0) / sq).sqrt()

    @property
    def relative_factor_error(self) -> torch.Tensor:
        """[L] ρ = √mean_{o,i} (κ r_o c_i / D_oi − 1)²: the factored map's error relative to each entry of D.

        Under Adam every entry of P g is of one scale (E g² ∝ 1/D²), so ρ, not ``factor_error`` (dominated by
        D's largest entries, where v has not formed and gradients are small), sizes the error the factorisation
        puts into ⟨P G_i, P G_j⟩. With q = r cᵀ/D and κ = 1/√mean q², ρ² = 2 − 2κ·mean q.
        """
        mean_q, _ = self._ratio_moments()
        return (2 - 2 * self.norm_scale * mean_q).clamp(min=0).sqrt()

    @property
    def norm_scale(self) -> torch.Tensor:
        """[L] κ = 1/√mean_{o,i} (r_o c_i / D_oi)²: the factors' rescaling that keeps E‖P G‖² where every entry of
        P g is of one scale (E g_oi² ∝ 1/D_oi², Adam's normalisation): E‖κ (r cᵀ) ⊙ G‖² ∝ κ² Σ (r_o c_i/D_oi)² = Σ 1.

        Without it the best rank-1 factors in Frobenius norm overweight the entries where D is small (formed v,
        large gradients) and bias every ⟨S_i, S_j⟩ of the factored sketch upward (+18% in squared norm on a tiny
        GPT after 300 AdamW steps, bench/results/ghost/README.md).
        """
        _, mean_q2 = self._ratio_moments()
        return mean_q2.rsqrt()

    def _ratio_moments(self) -> tuple[torch.Tensor, torch.Tensor]:
        """([L] mean q, [L] mean q²) of q = r cᵀ / D, in one pass over D (ones for vectors: their factors are D)."""
        if self._moments is None:
            r, c = self.rank1()
            if c.shape[-1] == 0:
                ones = torch.ones(self.D.shape[0], device=self.D.device)
                self._moments = (ones, ones)
            else:
                q = torch.mul(r[..., None], c[:, None]).div_(self.D)
                self._moments = (q.mean((1, 2)), q.square_().mean((1, 2)))
        return self._moments

    def apply(self, g: torch.Tensor) -> torch.Tensor:
        return (lead(self.D, g.ndim) * g).mul_(lead(self.C, g.ndim))

    def utility_vector(self, gbar: torch.Tensor) -> torch.Tensor:
        return self.apply(gbar)

    def rank1(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Best rank-1 r cᵀ ≈ D per layer (power iteration on the positive matrices): r [L, d_out], c [L, d_in]."""
        if self._factors is None:
            D = self.D
            if D.ndim == 2:  # vectors (biases, norms): D itself, no column factor
                self._factors = (D, D.new_ones(D.shape[0], 0))
                return self._factors
            c = D.mean(1)
            for _ in range(POWER_ITERATIONS):  # batched matrix–vector products (einsum's dispatch costs more at these sizes)
                r = torch.bmm(D, c[..., None])[..., 0].div_((c * c).sum(1, keepdim=True))
                c = torch.bmm(r[:, None], D)[:, 0].div_((r * r).sum(1, keepdim=True))
            self._factors = (r, c)
        return self._factors

    def token_factors(self, b: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scale_b, scale_a = self.token_maps()
        return lead(scale_b, b.ndim) * b, lead(scale_a, a.ndim) * a

    def token_maps(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(C·κ·r [L, d_out], c [L, d_in]): token_factors(b, a) = (C·κ·r ⊙ b, c ⊙ a), the rescaled rank-1 map
        (:attr:`norm_scale`), for sketches that fold the scales in."""
        r, c = self.rank1()
        return (lead(self.C, 2) * self.norm_scale[:, None]) * r, c


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
    momentum is zero and the point is coef·ḡ, the update torch would take on the proxy gradient (NS has no
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

    ``u`` is one matrix [m, n] or a stack [L, m, n] (then L [L, d, d] and norms [L]).
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


def _adamw_map(
    opt: torch.optim.Optimizer, group: dict, params: Sequence[torch.nn.Parameter], gbar: torch.Tensor) -> DiagonalMap:
    if group.get("maximize", False):
        raise ValueError("AdamW with maximize=True is not supported by the ghost preconditioner")
    beta1, beta2 = group["betas"]
    lr, eps = float(group["lr"]), group["eps"]
    states = [opt.state.get(p, {}) for p in params]
    v = _stacked_state(states, "exp_avg_sq", gbar)
    if all("step" in st for st in states):  # one stack and one read, not a read per parameter
        steps = [int(s) for s in torch.stack([torch.as_tensor(st["step"], dtype=torch.float32) for st in states]).tolist()]
    else:
        steps = [int(st["step"]) if "step" in st else 0 for st in states]
    if group.get("amsgrad", False) and any("max_exp_avg_sq" in st for st in states):  # zeros where missing: max(0, v) = v
        v = torch.maximum(_stacked_state(states, "max_exp_avg_sq", gbar) / beta2, v)
    bc2 = [1.0 - beta2 ** (s + 1) for s in steps]
    formed = v.flatten(1).amax(1) > 0
    if bool(formed.all()):  # v itself: no pass over the proxy's share
        floor = TENSOR_FLOOR * v.flatten(1).mean(1)  # rows no step has touched
        x = torch.clamp(v, min=lead(floor, v.ndim))
    else:  # v itself, the proxy's share (1 − β2)/β2·ḡ² of the next v only in layers whose v has not formed
        x = torch.where(lead(formed, v.ndim), v, gbar.float().square().mul_((1 - beta2) / beta2))
        floor = TENSOR_FLOOR * x.flatten(1).mean(1)  # rows neither trained nor in the proxy
        torch.maximum(x, lead(floor, x.ndim), out=x)
    # 1/(√(β2·x) + ε√bc2) = (1/√β2)·1/(√x + ε√(bc2/β2)): the 1/√β2 joins C (one pass fewer over every weight)
    C = per_layer([lr * (1 - beta1) * math.sqrt(b2 / beta2) / (1 - beta1 ** (s + 1)) for b2, s in zip(bc2, steps)], gbar.device)
    eps_term = lead(per_layer([eps * math.sqrt(b2 / beta2) for b2 in bc2], gbar.device), x.ndim)
    return DiagonalMap(C, x.sqrt_().add_(eps_term).reciprocal_())


def _stacked_state(states: list[dict], key: str, like: torch.Tensor) -> torch.Tensor:
    """The optimizer state ``key`` of each parameter stacked in float32 (zeros where it has not formed; one
    float32 state is viewed, not copied: read it, never write it)."""
    if len(states) == 1 and key in states[0]:
        return states[0][key].float().unsqueeze(0)
    if all(key in st for st in states):
        return torch.stack([st[key] for st in states]).float()
    return torch.stack([st[key].float() if key in st else torch.zeros_like(g, dtype=torch.float32) for st, g in zip(states, like)])


def _muon_map(opt: torch.optim.Optimizer, group: dict, params: Sequence[torch.nn.Parameter], gbar: torch.Tensor) -> MuonMap:
    mu, nesterov = group["momentum"], group["nesterov"]
    bufs = [opt.state.get(p, {}).get("momentum_buffer") for p in params]
    coef = (1 - mu * mu) if nesterov else (1 - mu)
    carry = mu * mu if nesterov else mu
    ns = NewtonSchulz(tuple(group["ns_coefficients"]), group["ns_steps"], group["eps"])
    lr = _adjust_lr(float(group["lr"]), group["adjust_lr_fn"], params[0].shape)
    # the momentum's share U(0), or before the first step the proxy's update
    ref = torch.stack([coef * g.float() if buf is None else carry * buf.float() for g, buf in zip(gbar, bufs)])
    if ref.device.type == "cpu":  # one eigendecomposition gives the left factor and the VJP
        at_ref = ns.spectral(ref)
        return MuonMap(lr * coef / at_ref.norm, at_ref.L, at_ref.tall, at_ref, lr * coef, ns)
    # accelerators stay in matrix products (NewtonSchulz.vjp)
    L, norm, tall = newton_schulz_left_factor(ref, ns.coefficients, ns.steps, ns.eps)
    return MuonMap(lr * coef / norm, L, tall, ref, lr * coef, ns)


def _sgd_map(opt: torch.optim.Optimizer, group: dict, params: Sequence[torch.nn.Parameter], gbar: torch.Tensor) -> ScalarMap:
    if group.get("maximize", False):
        raise ValueError("SGD with maximize=True is not supported by the ghost preconditioner")
    mu, damp, nesterov = group["momentum"], group["dampening"], group["nesterov"]
    coefs = []
    for p in params:
        has_buf = opt.state.get(p, {}).get("momentum_buffer") is not None
        coef = 1.0 if mu == 0 or not has_buf else (1 - damp)
        coefs.append(float(group["lr"]) * ((1.0 + mu * coef) if nesterov else coef))
    return ScalarMap(per_layer(coefs, gbar.device))


_MAPS: dict[type, Callable] = {torch.optim.SGD: _sgd_map, torch.optim.AdamW: _adamw_map, torch.optim.Muon: _muon_map}
SUPPORTED = "torch.optim.SGD, torch.optim.AdamW, torch.optim.Muon, selection_callbacks.nn.optim.MuonWithAdamW"


class Resolver(Protocol):
    """Maps stacked parameters of one shape (and one ``group_key``) to their preconditioner."""

    def group_key(self, param: torch.nn.Parameter) -> Hashable:
        """Parameters may share one stacked map only if their keys are equal."""
        ...

    def stacks(self, param: torch.nn.Parameter) -> bool:
        """Whether same-shaped parameters of this one's group gain from one stacked map where stacking saves no
        kernel launches (a CPU): maps that do many small operations per matrix."""
        ...

    def __call__(self, params: Sequence[torch.nn.Parameter], gbar: torch.Tensor) -> Preconditioner:
        """The map of ``params`` (``gbar`` [L, *shape], the proxy gradients, stand in for missing state)."""
        ...


class OptimizerPreconditioner:
    """Resolves parameters to their maps from the live optimizer (per step: the state moves).

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

    def group_key(self, param: torch.nn.Parameter) -> Hashable:
        """The parameter's optimizer group: one set of hyperparameters."""
        return id(self._locate(param)[1])

    def stacks(self, param: torch.nn.Parameter) -> bool:
        """Muon's maps: one eigendecomposition batch and one scalar recursion per stack (on cpu-tiny, 1.63 → 1.57×
        random's step); the elementwise maps gain nothing and would hold every stacked layer's captures."""
        return type(self._locate(param)[0]) is torch.optim.Muon

    def __call__(self, params: Sequence[torch.nn.Parameter], gbar: torch.Tensor) -> Preconditioner:
        """The stacked map for ``params`` (one optimizer group), ``gbar`` [L, *shape]."""
        opt, group = self._locate(params[0])
        if any(self._locate(p)[1] is not group for p in params[1:]):
            raise ValueError("stacked parameters must share one optimizer group (see group_key)")
        return _MAPS[type(opt)](opt, group, params, gbar)

    def _locate(self, param: torch.nn.Parameter) -> tuple[torch.optim.Optimizer, dict]:
        if id(param) not in self._where:
            raise KeyError("a scored parameter is not in the optimizer")
        return self._where[id(param)]


class IdentityPreconditioner:
    """P = c·I for every parameter: plain gradient geometry with step size c."""

    def __init__(self, c: float = 1.0) -> None:
        self.c = c

    def group_key(self, param: torch.nn.Parameter) -> Hashable:
        return None

    def stacks(self, param: torch.nn.Parameter) -> bool:
        return False

    def __call__(self, params: Sequence[torch.nn.Parameter], gbar: torch.Tensor) -> Preconditioner:
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

    def group_key(self, param: torch.nn.Parameter) -> Hashable:
        if id(param) not in self._lr:
            raise KeyError("a scored parameter is not in the optimizer")
        return None

    def stacks(self, param: torch.nn.Parameter) -> bool:
        return False

    def __call__(self, params: Sequence[torch.nn.Parameter], gbar: torch.Tensor) -> Preconditioner:
        return ScalarMap(per_layer([self._lr[id(p)] / self.batch for p in params], gbar.device))
