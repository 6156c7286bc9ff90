"""AdamW's map: its step linearised in the fresh gradient at frozen moments, a diagonal P."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from selection_callbacks.scoring.maps.base import Scale, check_minimizes, lead, per_layer, register_map, whole

TENSOR_FLOOR = 1e-2  # x's floor, relative to its layer's mean (see DiagonalMap)
POWER_ITERATIONS = 2  # power iterations of the rank-1 factorisation D ≈ r cᵀ


class DiagonalMap:
    """P g = C·(D ⊙ g): AdamW's step linearised in the fresh gradient; D [L, *shape], C a number or [L].

    Torch's AdamW at step s+1 moves θ by −lr/(1−β1^(s+1)) · m'/(√v'/√(1−β2^(s+1)) + ε) with
    m' = β1 m + (1−β1) g and v' = β2 v + (1−β2) g². Its derivative at g → 0 (moments frozen,
    ∂v'/∂g = 0 there) is diagonal: C = lr(1−β1)√(1−β2^(s+1))/(1−β1^(s+1)) and
    D = 1/(√(β2 x) + ε√(1−β2^(s+1))), P = −J, and ``utility_vector`` is ``apply``, with x = v, the
    derivative at g → 0. A layer whose v is still zero (every entry: before its first step) takes
    x = (1−β2)/β2·ḡ², the target gradient's share of the next v, instead, where the derivative (lr/ε) would not
    describe Adam's first, normalised step (C·D = lr/(|ḡ| + ε) there, Adam's first step on ḡ).

    x is floored at ``TENSOR_FLOOR`` times the layer's mean, for entries no step and no
    target row has touched (embedding rows never seen), where D would otherwise explode. The map
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
        D's largest entries, where v is still small and gradients are small), sizes the error the factorisation
        puts into ⟨P G_i, P G_j⟩. With q = r cᵀ/D and κ = 1/√mean q², ρ² = 2 − 2κ·mean q.
        """
        mean_q, _ = self._ratio_moments()
        return (2 - 2 * self.norm_scale * mean_q).clamp(min=0).sqrt()

    @property
    def norm_scale(self) -> torch.Tensor:
        """[L] κ = 1/√mean_{o,i} (r_o c_i / D_oi)²: the factors' rescaling that keeps E‖P G‖² where every entry of
        P g is of one scale (E g_oi² ∝ 1/D_oi², Adam's normalisation): E‖κ (r cᵀ) ⊙ G‖² ∝ κ² Σ (r_o c_i/D_oi)² = Σ 1.

        Without it the best rank-1 factors in Frobenius norm overweight the entries where D is small (large v,
        large gradients) and bias every ⟨S_i, S_j⟩ of the factored sketch upward.
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


@register_map(torch.optim.AdamW)
def adamw_map(opt: torch.optim.Optimizer, group: dict, params: Sequence[torch.nn.Parameter], gbar: torch.Tensor) -> DiagonalMap:
    """AdamW's map of the grouped ``params`` of ``group`` at frozen moments (:class:`DiagonalMap`).

    Raises:
        ValueError: ``maximize=True``.
    """
    check_minimizes(group, "AdamW")
    beta1, beta2 = group["betas"]
    lr, eps = float(group["lr"]), group["eps"]
    states = [opt.state.get(p, {}) for p in params]
    v = _grouped_state(states, "exp_avg_sq", gbar)
    if all("step" in st for st in states):  # one group and one read, not a read per parameter
        steps = [int(s) for s in torch.stack([torch.as_tensor(whole(st["step"]), dtype=torch.float32) for st in states]).tolist()]
    else:
        steps = [int(whole(st["step"])) if "step" in st else 0 for st in states]
    if group.get("amsgrad", False) and any("max_exp_avg_sq" in st for st in states):  # zeros where missing: max(0, v) = v
        v = torch.maximum(_grouped_state(states, "max_exp_avg_sq", gbar) / beta2, v)
    bc2 = [1.0 - beta2 ** (s + 1) for s in steps]
    started = v.flatten(1).amax(1) > 0
    if bool(started.all()):  # v itself: no pass over the target gradient's share
        floor = TENSOR_FLOOR * v.flatten(1).mean(1)  # rows no step has touched
        x = torch.clamp(v, min=lead(floor, v.ndim))
    else:  # v itself, the target gradient's share (1 − β2)/β2·ḡ² of the next v only in layers whose v is still zero
        x = torch.where(lead(started, v.ndim), v, gbar.float().square().mul_((1 - beta2) / beta2))
        floor = TENSOR_FLOOR * x.flatten(1).mean(1)  # rows neither trained nor in the target rows
        torch.maximum(x, lead(floor, x.ndim), out=x)
    # 1/(√(β2·x) + ε√bc2) = (1/√β2)·1/(√x + ε√(bc2/β2)): the 1/√β2 joins C (one pass fewer over every weight)
    C = per_layer([lr * (1 - beta1) * math.sqrt(b2 / beta2) / (1 - beta1 ** (s + 1)) for b2, s in zip(bc2, steps)], gbar.device)
    eps_term = lead(per_layer([eps * math.sqrt(b2 / beta2) for b2 in bc2], gbar.device), x.ndim)
    return DiagonalMap(C, x.sqrt_().add_(eps_term).reciprocal_())


def _grouped_state(states: list[dict], key: str, like: torch.Tensor) -> torch.Tensor:
    """The optimizer state ``key`` of each parameter, whole (:func:`whole`), as one [L, *shape]
    float32 tensor (zeros where it has none yet; one float32 state is viewed, not copied: read it, never write it)."""
    if len(states) == 1 and key in states[0]:
        return whole(states[0][key]).float().unsqueeze(0)
    if all(key in st for st in states):
        return torch.stack([whole(st[key]) for st in states]).float()
    return torch.stack([whole(st[key]).float() if key in st else torch.zeros_like(g, dtype=torch.float32)
                        for st, g in zip(states, like)])

