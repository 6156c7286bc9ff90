"""Unbiased m-dimensional sketches of per-sample gradients Σ_t b'_t a'_tᵀ, never forming them.

- :class:`TensorSketch`: the CountSketch of the outer product under the hash (h1(o) + h2(i)) mod n,
  sign s1(o)s2(i), computed from the factors in the frequency domain (dense products with the
  hashes' DFT rows, summed over tokens). E⟨S_i, S_j⟩ = ⟨G_i, G_j⟩, error ~ 1/√n. Each layer may
  own a block of n of the m bins (the engine's layout) or spread over all m.
- :class:`CountSketch`: the reference for any map P: form P G_i in candidate chunks and hash
  every entry with fully independent tables (~9 bytes per weight).
- :class:`TwoSidedProjection`: Σ_t (R_o b'_t)(R_i a'_t)ᵀ with Gaussian R, m = m_o·m_i; unbiased,
  but for low-rank G its error decays only like m^(-1/4).
Each layer draws its own hashes and signs from (seed, layer index), so per-layer sketches add into
one m-dimensional vector and inner products stay unbiased across layers. Every sketch takes a group of L
same-shaped layers along a leading dimension and returns their sum.
"""

from __future__ import annotations

import math

import torch

from selection_callbacks.scoring.maps.base import rows_matmul


def _generator(seed: int, layer: int) -> torch.Generator:
    return torch.Generator().manual_seed(1_000_003 * int(seed) + 7919 * int(layer) + 17)


class TensorSketch:
    """TensorSketch of per-token outer products, summed over tokens; each layer in its own block of bins.

    Layer k (of the L grouped) hashes entry (o, i) of G = Σ_t b_t a_tᵀ to bin
    ``offsets[k] + (h1(o) + h2(i)) mod n`` with sign s1(o)s2(i), n = ``block`` bins per layer. That
    CountSketch of G is the circular convolution Σ_t CS1(b_t) ⊛ CS2(a_t), whose real DFT is
    Σ_t (b_t H1) ⊙ (a_t H2) with H[o, k] = s(o)·e^(−2πi·k·h(o)/n), k ≤ n/2. Two dense products with
    n + 2 real columns per side (then one small inverse FFT per candidate) replace the count sketches'
    scatter and the per-token FFTs: NT·(d_out + d_in)·(n + 2) multiply-adds per layer, linear in n.
    See :func:`sketch_blocks` for how the engine splits its m bins.

    Args:
        m: sketch dimension (the output has m columns).
        d_out, d_in: factor dimensions.
        seed: selects the hash functions together with each layer index.
        layers: the layer indices of the grouped layers.
        block: bins per layer, n (None: m, every layer over all m bins, their sketches summed).
        offsets: each grouped layer's first bin (with ``block``).
    """

    def __init__(
        self, m: int, d_out: int, d_in: int, seed: int, layers: list[int], device: torch.device,
        block: int | None = None, offsets: list[int] | None = None,
    ) -> None:
        self.m, self.n = m, block or m
        self.offsets = list(offsets) if block else [0] * len(layers)
        if len(self.offsets) != len(layers) or min(self.offsets) < 0 or max(self.offsets) + self.n > m:
            raise ValueError(f"layer blocks of {self.n} bins at {self.offsets} do not fit {len(layers)} layers in m={m} bins")
        tables = [self._hashes(self.n, d_out, d_in, _generator(seed, layer)) for layer in layers]
        self.h1, self.s1, self.h2, self.s2 = (torch.stack(t).to(device) for t in zip(*tables))
        self.f1, self.f2 = self._dft(self.h1, self.s1), self._dft(self.h2, self.s2)
        self.columns = (torch.tensor(self.offsets, device=device)[:, None] + torch.arange(self.n, device=device)).flatten()
        self._signs: torch.Tensor | None = None
        self._scatter: tuple[torch.Tensor, torch.Tensor] | None = None

    @staticmethod
    def _hashes(n: int, d_out: int, d_in: int, g: torch.Generator) -> tuple[torch.Tensor, ...]:
        h1 = torch.randint(0, n, (d_out,), generator=g)
        s1 = (torch.randint(0, 2, (d_out,), generator=g) * 2 - 1).float()
        h2 = torch.randint(0, n, (d_in,), generator=g)
        s2 = (torch.randint(0, 2, (d_in,), generator=g) * 2 - 1).float()
        return h1, s1, h2, s2

    def _dft(self, h: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        """[L, d, 2(n//2 + 1)]: H[o, k] = s(o)·e^(−2πi·k·h(o)/n) as interleaved (real, imaginary) columns."""
        k = torch.arange(self.n // 2 + 1, device=h.device)
        phase = (h[..., None] * k % self.n).double() * (-2 * math.pi / self.n)  # reduced mod n: exact angles
        return torch.stack([phase.cos(), phase.sin()], -1).mul_(s[..., None, None]).flatten(-2).float()

    def explicit(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(bins, signs) [L, d_out·d_in] of every weight entry: the CountSketch this sketch computes without forming G."""
        bins = (self.h1[:, :, None] + self.h2[:, None, :]) % self.n + torch.tensor(self.offsets, device=self.h1.device)[:, None, None]
        return bins.flatten(1), (self.s1[:, :, None] * self.s2[:, None, :]).flatten(1)

    def __call__(self, b: torch.Tensor, a: torch.Tensor, scale_b=None, scale_a=None) -> torch.Tensor:
        """b [L, N, T, d_out], a [L, N, T, d_in] → [N, m]; ``scale_b`` and ``scale_a`` map b and a first (see :func:`_rows`)."""
        fb = rows_matmul(b.float(), _rows(self.f1, scale_b))  # [L, N, T, 2(n//2 + 1)]
        fa = rows_matmul(a.float(), _rows(self.f2, scale_a))
        return self._place((_complex(fb) * _complex(fa)).sum(2))

    def one_hot(self, b: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """One embedding (L = 1): G = Σ_t e_{x_t} b_tᵀ with b [N, T, d] (the "out" factor is the one-hot row index)."""
        fa = rows_matmul(b[None].float(), self.f2)
        return self._place((_complex(self.f1[:, ids]) * _complex(fa)).sum(2))

    def signs(self) -> torch.Tensor:
        """[L, d_out, d_in] s1(o)·s2(i): the sign of each weight entry (to fold into a map applied to formed matrices;
        formed once, read only)."""
        if self._signs is None:
            self._signs = self.s1[:, :, None] * self.s2[:, None, :]
        return self._signs

    def matrices(self, mats: torch.Tensor) -> torch.Tensor:
        """mats [L, N, d_out, d_in] → [N, m]: the same CountSketch of explicit matrices (e.g. a formed P G_i)."""
        return self.signed_matrices(mats.float().mul(self.signs()[:, None]).transpose(0, 1))

    def signed_matrices(self, signed: torch.Tensor) -> torch.Tensor:
        """signed [N, L, d_out, d_in], the matrices times :meth:`signs` → [N, m], their CountSketch under this hash.

        Two scatters: rows into their bins, Y[j, i] = Σ_{h1(o)=j} (s M)[o, i] (N·d_out·d_in adds), then
        column i of Y into bin (j + h2(i)) mod n (N·n·d_in adds).
        """
        N, L, d_out, d_in = signed.shape
        row_bins, column_bins = self._scatter_indices()
        rows = torch.zeros(N, L * self.n, d_in, device=signed.device)
        rows.index_add_(1, row_bins, signed.reshape(N, L * d_out, d_in))
        out = torch.zeros(N, L * self.n, device=signed.device).index_add_(1, column_bins, rows.flatten(1))
        return self._place_bins(out.unflatten(1, (L, self.n)).transpose(0, 1))

    def _scatter_indices(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The two scatters' targets, formed once: row o of layer k to lane k·n + h1(o) [L·d_out], and entry (j, i) of
        that lane to bin k·n + (j + h2(i)) mod n [L·n·d_in]."""
        if self._scatter is None:
            lanes = torch.arange(self.h1.shape[0], device=self.h1.device)[:, None] * self.n
            bins = lanes[:, :, None] + (torch.arange(self.n, device=self.h1.device)[:, None] + self.h2[:, None, :]) % self.n
            self._scatter = ((lanes + self.h1).flatten(), bins.flatten())
        return self._scatter

    def _place(self, spectrum: torch.Tensor) -> torch.Tensor:
        """[L, N, n//2 + 1] per-layer spectra → [N, m]: each layer's count sketch in its block."""
        return self._place_bins(torch.fft.irfft(spectrum, n=self.n))

    def _place_bins(self, sketches: torch.Tensor) -> torch.Tensor:
        """[L, N, n] per-layer count sketches → [N, m]: each in its block (or all summed over the m bins)."""
        if self.n == self.m:
            return sketches.sum(0)
        out = sketches.new_zeros(sketches.shape[1], self.m)
        return out.index_add_(1, self.columns, sketches.transpose(0, 1).flatten(1))


def sketch_blocks(sizes: list[int], m: int) -> list[tuple[int, int]]:
    """(first bin, bins) of each layer: m bins split in proportion to the layers' weight sizes.

    The error of ⟨S_i, S_j⟩ summed over per-layer blocks of n_l bins is ~ Σ_l ‖G_l‖²‖G'_l‖²/n_l,
    least (and equal to one m-bin sketch common to all layers' (Σ_l ‖G_l‖²)(Σ_l ‖G'_l‖²)/m) with n_l ∝ the
    layers' shares of the squared norms. Under an adaptive optimizer every weight's step is of
    one scale, so a layer's share of ‖P G‖² goes with its size: blocks ∝ d_out·d_in.
    """
    total = sum(sizes)
    bins = [m * s // total for s in sizes]
    if min(bins) < 1:
        raise ValueError(f"sketch_dim={m} leaves a layer of {min(sizes)} weights no bin of its own ({len(sizes)} layers, "
                         f"{total} weights); raise sketch_dim or score fewer layers")
    offsets = [sum(bins[:i]) for i in range(len(bins))]
    return list(zip(offsets, bins))


class CountSketch:
    """CountSketch of vec(M) for explicit matrices, summed over L grouped layers (the reference sketch)."""

    def __init__(self, m: int, d_out: int, d_in: int, seed: int, layers: list[int], device: torch.device) -> None:
        self.m = m
        tables = []
        for layer in layers:
            g = _generator(seed, layer)
            h = torch.randint(0, m, (d_out * d_in,), generator=g)
            tables.append((h, (torch.randint(0, 2, (d_out * d_in,), generator=g) * 2 - 1).float()))
        self.h, self.s = (torch.stack(t).to(device) for t in zip(*tables))

    def __call__(self, mats: torch.Tensor) -> torch.Tensor:
        """mats [L, n, d_out, d_in] → [n, m]."""
        flat = mats.flatten(2).float() * self.s[:, None, :]
        out = torch.zeros(*flat.shape[:2], self.m, device=mats.device)
        return out.scatter_add_(2, self.h[:, None, :].expand(*flat.shape), flat).sum(0)


class TwoSidedProjection:
    """Σ_l Σ_t (R_o b_t)(R_i a_t)ᵀ flattened over L grouped layers, R entries N(0, 1/m_side): m = m_side²."""

    def __init__(self, m: int, d_out: int, d_in: int, seed: int, layers: list[int], device: torch.device) -> None:
        side = int(math.isqrt(m))
        if side * side != m:
            raise ValueError(f"two-sided projection needs a square sketch dimension, got m={m}")
        ro, ri = [], []
        for layer in layers:
            g = _generator(seed, layer)
            ro.append(torch.randn(side, d_out, generator=g) / math.sqrt(side))
            ri.append(torch.randn(side, d_in, generator=g) / math.sqrt(side))
        self.ro, self.ri = torch.stack(ro).to(device), torch.stack(ri).to(device)

    def __call__(self, b: torch.Tensor, a: torch.Tensor, scale_b=None, scale_a=None) -> torch.Tensor:
        """b [L, N, T, d_out], a [L, N, T, d_in] → [N, m]; ``scale_b`` and ``scale_a`` map b and a first (see :func:`_rows`)."""
        pb = rows_matmul(b.float(), _rows(self.ro.mT, scale_b))  # [L, N, T, side]
        pa = rows_matmul(a.float(), _rows(self.ri.mT, scale_a))
        return torch.einsum("lnto,lnti->noi", pb, pa).reshape(b.shape[1], -1)


def _rows(f: torch.Tensor, scale) -> torch.Tensor:
    """Per-layer rows f [L, d, k] (a sketch's DFT rows, a projection's transpose) of factors x mapped first by
    ``scale``: a factor ([L, d], [L, 1] or a number) that multiplies x's coordinates, or a matrix M [L, d, d] that
    sends x to x M (then (x M) f = x (M f)); None: the rows as they are."""
    if scale is None:
        return f
    if isinstance(scale, torch.Tensor) and scale.ndim == 3:
        return scale @ f
    return f * (scale[..., None] if isinstance(scale, torch.Tensor) else scale)


def _complex(x: torch.Tensor) -> torch.Tensor:
    """[..., 2k] interleaved (real, imaginary) → [..., k] complex (a view)."""
    return torch.view_as_complex(x.unflatten(-1, (-1, 2)))
