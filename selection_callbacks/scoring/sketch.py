"""Unbiased m-dimensional sketches of per-sample gradients Σ_t b'_t a'_tᵀ, never forming them.

- :class:`TensorSketch`: CountSketch each factor (hashes h1, h2, signs s1, s2), multiply their
  FFTs and sum over tokens: the CountSketch of the outer product under the hash
  (h1(o) + h2(i)) mod m, sign s1(o)s2(i). E⟨S_i, S_j⟩ = ⟨G_i, G_j⟩, error ~ 1/√m.
- :class:`CountSketch`: the reference for any map P: form P G_i in candidate chunks and hash
  every entry with fully independent tables (~9 bytes per weight).
- :class:`TwoSidedProjection`: Σ_t (R_o b'_t)(R_i a'_t)ᵀ with Gaussian R, m = m_o·m_i; unbiased,
  but for low-rank G its error decays only like m^(-1/4).
Each layer draws its own hashes from (seed, layer index), so per-layer sketches add into one
m-dimensional vector and inner products stay unbiased across layers. Every sketch takes L
same-shaped layers stacked along a leading dimension and returns their sum.
"""

from __future__ import annotations

import math

import torch

from selection_callbacks.scoring.preconditioners import rows_matmul

def _generator(seed: int, layer: int) -> torch.Generator:
    return torch.Generator().manual_seed(1_000_003 * int(seed) + 7919 * int(layer) + 17)


class TensorSketch:
    """TensorSketch of per-token outer products, summed over tokens and over L stacked layers.

    Each layer draws its own hashes from (seed, layer index); the layers' count sketches land in
    one [L, n, T, m] tensor, so a group of same-shaped layers costs one scatter, one FFT pair and
    one inverse FFT (the sum over layers and tokens is taken in the frequency domain).

    Args:
        m: sketch dimension.
        d_out, d_in: factor dimensions.
        seed: selects the hash functions together with each layer index.
        layers: the layer indices of the stacked layers.
        chunk_elements: candidates per FFT chunk are chosen so that chunk·L·T·m stays within this
            many numbers. Default: 2^19 on CPU (cache-sized FFTs), 2^23 elsewhere (fewer, larger
            chunks: fewer kernel launches on a GPU).
    """

    def __init__(
        self, m: int, d_out: int, d_in: int, seed: int, layers: list[int], device: torch.device, chunk_elements: int | None = None
    ) -> None:
        self.m = m
        self.chunk_elements = chunk_elements or (1 << 19 if torch.device(device).type == "cpu" else 1 << 23)
        tables = [self._hashes(m, d_out, d_in, _generator(seed, layer)) for layer in layers]
        self.h1, self.s1, self.h2, self.s2 = (torch.stack(t).to(device) for t in zip(*tables))

    @staticmethod
    def _hashes(m: int, d_out: int, d_in: int, g: torch.Generator) -> tuple[torch.Tensor, ...]:
        h1 = torch.randint(0, m, (d_out,), generator=g)
        s1 = (torch.randint(0, 2, (d_out,), generator=g) * 2 - 1).float()
        h2 = torch.randint(0, m, (d_in,), generator=g)
        s2 = (torch.randint(0, 2, (d_in,), generator=g) * 2 - 1).float()
        return h1, s1, h2, s2

    def _count(self, x: torch.Tensor, h: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        """x [L, n, T, d] → [L, n, T, m], hashing each layer's d coordinates by its own h, s [L, d]."""
        out = torch.zeros(*x.shape[:-1], self.m, device=x.device, dtype=torch.float32)
        index = h[:, None, None, :].expand(*x.shape)
        return out.scatter_add_(-1, index, x.float() * s[:, None, None, :])

    def _chunk(self, layers: int, tokens: int) -> int:
        return max(1, self.chunk_elements // (layers * tokens * self.m))

    def __call__(self, b: torch.Tensor, a: torch.Tensor, scale_b=None, scale_a=None) -> torch.Tensor:
        """b [L, N, T, d_out], a [L, N, T, d_in] → [N, m]; optional scales ([L, d], [L, 1] or numbers) multiply b and a first."""
        s1 = self.s1 if scale_b is None else self.s1 * scale_b
        s2 = self.s2 if scale_a is None else self.s2 * scale_a
        out, chunk = [], self._chunk(b.shape[0], b.shape[2])
        for i in range(0, b.shape[1], chunk):
            fb = torch.fft.rfft(self._count(b[:, i : i + chunk], self.h1, s1), n=self.m)
            fa = torch.fft.rfft(self._count(a[:, i : i + chunk], self.h2, s2), n=self.m)
            out.append(torch.fft.irfft(fb.mul_(fa).sum((0, 2)), n=self.m))
        return torch.cat(out)

    def one_hot(self, b: torch.Tensor, ids: torch.Tensor, vocab: int) -> torch.Tensor:
        """One embedding (L = 1): G = Σ_t e_{x_t} b_tᵀ with b [N, T, d] (the "out" factor is the one-hot row index)."""
        h1, s1 = self.h1[0], self.s1[0]
        out, chunk = [], self._chunk(1, b.shape[1])
        for i in range(0, b.shape[0], chunk):
            idc = ids[i : i + chunk]
            cs_row = torch.zeros(*idc.shape, self.m, device=b.device)
            cs_row.scatter_(-1, h1[idc].unsqueeze(-1), s1[idc].unsqueeze(-1))
            fb = torch.fft.rfft(cs_row, n=self.m)
            fa = torch.fft.rfft(self._count(b[None, i : i + chunk], self.h2, self.s2)[0], n=self.m)
            out.append(torch.fft.irfft((fb * fa).sum(1), n=self.m))
        return torch.cat(out)


class CountSketch:
    """CountSketch of vec(M) for explicit matrices, summed over L stacked layers (the reference sketch)."""

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
    """Σ_l Σ_t (R_o b_t)(R_i a_t)ᵀ flattened over L stacked layers, R entries N(0, 1/m_side): m = m_side²."""

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
        """b [L, N, T, d_out], a [L, N, T, d_in] → [N, m]; optional scales ([L, d], [L, 1] or numbers) multiply b and a first."""
        ro = self.ro if scale_b is None else self.ro * _columns(scale_b)
        ri = self.ri if scale_a is None else self.ri * _columns(scale_a)
        pb = rows_matmul(b.float(), ro.mT)  # [L, N, T, side]
        pa = rows_matmul(a.float(), ri.mT)
        return torch.einsum("lnto,lnti->noi", pb, pa).reshape(b.shape[1], -1)


def _columns(scale):
    """A per-layer scale [L, d] (or [L, 1]) as [L, 1, d] to multiply the columns of [L, side, d] projections."""
    return scale[:, None, :] if isinstance(scale, torch.Tensor) else scale
