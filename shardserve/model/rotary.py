"""Rotary position embedding (RoPE): the inverse frequencies with their HF scalings, the table
of rotations, and one step's rotation shared by every layer (the C kernel or PyTorch)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from shardserve.model import native_kernels


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Inverse RoPE frequencies (float64), with optional "linear" or "llama3" scaling.

    `scaling` is an HF rope_scaling / rope_parameters dict; "default" (or None) means none.
    """
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim
    inv_freq = 1.0 / (theta**exponents)
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type in (None, "default"):
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])  # type: ignore[index]
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)  # type: ignore[arg-type]
    raise NotImplementedError(f"rope scaling type {rope_type!r} is not supported")


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, and the band between
    # low_freq_wavelen and high_freq_wavelen is interpolated smoothly between the two.
    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_ctx = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_mid = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
    return torch.where(is_mid, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """RoPE on interleaved pairs (see `layers.rope_interleave_perm`) as a complex multiply.

    The table holds cis(p * f) = cos + i sin for positions 0..P-1 as complex64; it grows on
    demand (doubling), driven by the host-side max sequence length, never by reading tensors.
    """

    def __init__(
        self, head_dim: int, theta: float, scaling: dict | None, dtype: torch.dtype, device="cpu"
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        # HF computes the angles in float32 (float32 inverse frequencies times positions).
        self.inv_freq = rope_inv_freq(head_dim, theta, scaling).float().to(device)
        self.table = torch.empty(0, head_dim // 2, dtype=torch.complex64, device=device)

    def _build(self, num_positions: int) -> None:
        pos = torch.arange(num_positions, dtype=torch.float32, device=self.inv_freq.device)
        angles = torch.outer(pos, self.inv_freq)
        self.table = torch.polar(torch.ones_like(angles), angles)

    def for_step(self, positions: torch.Tensor, max_position: int) -> RopeStep:
        """The rotation of one step's tokens at `positions`; `max_position` bounds them (a host
        int), so the table grows without reading a tensor."""
        if max_position >= self.table.shape[0]:
            self._build(max(2 * self.table.shape[0], max_position + 1, 256))
        return RopeStep(positions, self.table)


@dataclass
class RopeStep:
    """One step's RoPE, shared by all layers: the C kernel reads the table rows in place; the
    PyTorch path looks them up once (`cis`, [T, 1, D/2]) on first use."""

    positions: torch.Tensor  # int64 [T]
    table: torch.Tensor  # complex64 [P, D/2]
    _cis: torch.Tensor | None = None

    def apply_(self, x: torch.Tensor) -> None:
        """Rotate x [T, heads, D] (interleaved pairs) in place; x may be a view into qkv."""
        if x.stride(-1) == 1 and x.stride(1) == x.shape[2] and native_kernels.supports(
            x.dtype, x.device
        ):
            native_kernels.rope_(x, self.positions, torch.view_as_real(self.table))
            return
        if self._cis is None:
            self._cis = self.table.index_select(0, self.positions).unsqueeze(1)
        pairs = x.view(*x.shape[:-1], -1, 2)
        if x.dtype == torch.float32:
            torch.view_as_complex(pairs).mul_(self._cis)
        else:  # no bf16 complex type: rotate in float32 and write back
            rotated = torch.view_as_complex(pairs.float()) * self._cis
            pairs.copy_(torch.view_as_real(rotated))
