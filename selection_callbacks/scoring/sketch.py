"""Unbiased m-dimensional sketches of per-sample gradients Σ_t b'_t a'_tᵀ, never forming them.

- :class:`TensorSketch`: CountSketch each factor (hashes h1, h2, signs s1, s2), multiply their
  FFTs and sum over tokens: the CountSketch of the outer product under the hash
  (h1(o) + h2(i)) mod m, sign s1(o)s2(i). E⟨S_i, S_j⟩ = ⟨G_i, G_j⟩, error ~ 1/√m.
- :class:`CountSketch`: the reference for any map P: form P G_i in candidate chunks and hash
  every entry with fully independent tables (~9 bytes per weight).
- :class:`TwoSidedProjection`: Σ_t (R_o b'_t)(R_i a'_t)ᵀ with Gaussian R, m = m_o·m_i; unbiased,
  but for low-rank G its error decays only like m^(-1/4).
Each layer draws its own hashes from (seed, layer index), so per-layer sketches add into one
m-dimensional vector and inner products stay unbiased across layers.
"""

from __future__ import annotations

import math

import torch


def _generator(seed: int, layer: int) -> torch.Generator:
    return torch.Generator().manual_seed(1_000_003 * int(seed) + 7919 * int(layer) + 17)


class TensorSketch:
    """TensorSketch of per-token outer products, summed over tokens.

    Args:
        m: sketch dimension.
        d_out, d_in: factor dimensions.
        seed, layer: select the hash functions.
        chunk_elements: candidates per FFT chunk are chosen so that chunk·T·m stays within this
            many numbers. Default: 2^19 on CPU (cache-sized FFTs), 2^23 elsewhere (fewer, larger
            chunks: fewer kernel launches on a GPU).
    """

    def __init__(
        self, m: int, d_out: int, d_in: int, seed: int, layer: int, device: torch.device, chunk_elements: int | None = None
    ) -> None:
        g = _generator(seed, layer)
        self.m = m
        self.chunk_elements = chunk_elements or (1 << 19 if torch.device(device).type == "cpu" else 1 << 23)
        self.h1 = torch.randint(0, m, (d_out,), generator=g).to(device)
        self.s1 = (torch.randint(0, 2, (d_out,), generator=g) * 2 - 1).float().to(device)
        self.h2 = torch.randint(0, m, (d_in,), generator=g).to(device)
        self.s2 = (torch.randint(0, 2, (d_in,), generator=g) * 2 - 1).float().to(device)

    def _count(self, x: torch.Tensor, h: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(*x.shape[:-1], self.m, device=x.device, dtype=torch.float32)
        return out.index_add_(x.ndim - 1, h, x.float() * s)

    def _chunk(self, tokens: int) -> int:
        return max(1, self.chunk_elements // (tokens * self.m))

    def __call__(self, b: torch.Tensor, a: torch.Tensor, scale_b=None, scale_a=None) -> torch.Tensor:
        """b [N, T, d_out], a [N, T, d_in] → [N, m]; optional scales ([d] or scalars) multiply b and a first."""
        s1 = self.s1 if scale_b is None else self.s1 * scale_b
        s2 = self.s2 if scale_a is None else self.s2 * scale_a
        out, chunk = [], self._chunk(b.shape[1])
        for i in range(0, b.shape[0], chunk):
            fb = torch.fft.rfft(self._count(b[i : i + chunk], self.h1, s1), n=self.m)
            fa = torch.fft.rfft(self._count(a[i : i + chunk], self.h2, s2), n=self.m)
            out.append(torch.fft.irfft(fb.mul_(fa).sum(1), n=self.m))
        return torch.cat(out)

    def one_hot(self, b: torch.Tensor, ids: torch.Tensor, vocab: int) -> torch.Tensor:
        """Embedding rows: G = Σ_t e_{x_t} b_tᵀ with b [N, T, d] (the "out" factor is the one-hot row index)."""
        # treat the embedding weight [V, d] as d_out = V (hashed by h1 over ids), d_in = d
        out, chunk = [], self._chunk(b.shape[1])
        for i in range(0, b.shape[0], chunk):
            idc = ids[i : i + chunk]
            cs_row = torch.zeros(*idc.shape, self.m, device=b.device)
            cs_row.scatter_(-1, self.h1[idc].unsqueeze(-1), self.s1[idc].unsqueeze(-1))
            fb = torch.fft.rfft(cs_row, n=self.m)
            fa = torch.fft.rfft(self._count(b[i : i + chunk], self.h2, self.s2), n=self.m)
            out.append(torch.fft.irfft((fb * fa).sum(1), n=self.m))
        return torch.cat(out)


class CountSketch:
    """CountSketch of vec(M) for explicit matrices M [N, d_out, d_in] (the reference sketch)."""

    def __init__(self, m: int, d_out: int, d_in: int, seed: int, layer: int, device: torch.device) -> None:
        g = _generator(seed, layer)
        self.m = m
        self.h = torch.randint(0, m, (d_out * d_in,), generator=g).to(device)
        self.s = (torch.randint(0, 2, (d_out * d_in,), generator=g) * 2 - 1).float().to(device)

    def __call__(self, mats: torch.Tensor) -> torch.Tensor:
        flat = mats.reshape(mats.shape[0], -1).float() * self.s
        return torch.zeros(mats.shape[0], self.m, device=mats.device).index_add_(1, self.h, flat)


class TwoSidedProjection:
    """Σ_t (R_o b_t)(R_i a_t)ᵀ flattened, with R entries N(0, 1/m_side): m = m_side²."""

    def __init__(self, m: int, d_out: int, d_in: int, seed: int, layer: int, device: torch.device) -> None:
        side = int(math.isqrt(m))
        if side * side != m:
            raise ValueError(f"two-sided projection needs a square sketch dimension, got m={m}")
        g = _generator(seed, layer)
        self.ro = (torch.randn(side, d_out, generator=g) / math.sqrt(side)).to(device)
        self.ri = (torch.randn(side, d_in, generator=g) / math.sqrt(side)).to(device)

    def __call__(self, b: torch.Tensor, a: torch.Tensor, scale_b=None, scale_a=None) -> torch.Tensor:
        """b [N, T, d_out], a [N, T, d_in] → [N, m]; optional scales ([d] or scalars) multiply b and a first."""
        ro = self.ro if scale_b is None else self.ro * scale_b
        ri = self.ri if scale_a is None else self.ri * scale_a
        pb = b.float() @ ro.T  # [N, T, side]
        pa = a.float() @ ri.T
        return torch.einsum("nto,nti->noi", pb, pa).reshape(b.shape[0], -1)
