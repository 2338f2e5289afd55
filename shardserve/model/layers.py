"""Tensor-parallel-ready building blocks: norms, sharded linears, sharded vocab, RoPE tables.

Every parameter-owning layer holds only this rank's slice and attaches a
`weight_loader(param, full_tensor, shard_id=None)` to each parameter, so a checkpoint loader can
hand over full (unsharded) HF tensors and let the layer pick its slice. At tensor-parallel world
size 1 every slice is the whole tensor and every collective is the identity.

The layers are written for inference only: parameters never require grad and are allocated with
`torch.empty` (the model checks that every parameter was loaded).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from shardserve.distributed.parallel_state import get_tp_group

WeightLoader = Callable[[nn.Parameter, torch.Tensor, object], None]


def _empty_param(*shape: int, dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


def _copy_into(param: nn.Parameter, src: torch.Tensor) -> None:
    if tuple(param.shape) != tuple(src.shape):
        raise ValueError(f"shape mismatch: parameter {tuple(param.shape)} vs {tuple(src.shape)}")
    param.data.copy_(src)  # copy_ also casts dtype and moves device


def _divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what}={numerator} is not divisible by tensor-parallel size {denominator}")
    return numerator // denominator


class RMSNorm(nn.Module):
    """RMSNorm with an optional fused residual add (`forward(x, residual)`).

    With a residual, returns (norm(x + residual), x + residual): the sum becomes the next
    residual stream, which saves one separate add per sub-layer.
    """

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype, device="cpu") -> None:
        super().__init__()
        self.eps = eps
        self.shape = (hidden_size,)
        self.weight = _empty_param(hidden_size, dtype=dtype, device=device)
        self.weight.weight_loader = lambda p, t, shard_id=None: _copy_into(p, t)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return F.rms_norm(x, self.shape, self.weight, self.eps)
        residual = x + residual
        return F.rms_norm(residual, self.shape, self.weight, self.eps), residual


class ColumnParallelLinear(nn.Module):
    """y = x W^T (+ b) with W split along the output dim; each rank yields its output slice.

    `output_sizes` lists the full sizes of logically separate matrices stacked along the output
    dim (q/k/v, gate/up); each one is split evenly across ranks, so the local weight is the
    concatenation of every piece's local slice and one matmul computes them all.
    """

    def __init__(
        self,
        input_size: int,
        output_sizes: Sequence[int],
        bias: bool,
        dtype: torch.dtype,
        device="cpu",
    ) -> None:
        super().__init__()
        tp = get_tp_group()
        self.tp_rank, self.tp_size = tp.rank, tp.world_size
        self.full_sizes = list(output_sizes)
        self.local_sizes = [_divide(n, self.tp_size, "output size") for n in output_sizes]
        self.local_offsets = [sum(self.local_sizes[:i]) for i in range(len(self.local_sizes))]
        out_local = sum(self.local_sizes)
        self.weight = _empty_param(out_local, input_size, dtype=dtype, device=device)
        self.weight.weight_loader = self.weight_loader
        self.bias = _empty_param(out_local, dtype=dtype, device=device) if bias else None
        if self.bias is not None:
            self.bias.weight_loader = self.weight_loader

    def _shard_index(self, shard_id: object) -> int:
        if shard_id is None:
            if len(self.local_sizes) != 1:
                raise ValueError("a stacked linear needs a shard_id for each piece")
            return 0
        return int(shard_id)  # type: ignore[call-overload]

    def weight_loader(self, param: nn.Parameter, full: torch.Tensor, shard_id=None) -> None:
        idx = self._shard_index(shard_id)
        size = self.local_sizes[idx]
        if full.shape[0] != self.full_sizes[idx]:
            raise ValueError(f"expected {self.full_sizes[idx]} output rows, got {full.shape[0]}")
        local = full.narrow(0, self.tp_rank * size, size)
        _copy_into_rows(param, local, self.local_offsets[idx])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


def _copy_into_rows(param: nn.Parameter, src: torch.Tensor, offset: int) -> None:
    dst = param.data.narrow(0, offset, src.shape[0])
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"shape mismatch: parameter slice {tuple(dst.shape)} vs {tuple(src.shape)}")
    dst.copy_(src)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel matrices fused into one matmul (e.g. gate_proj + up_proj).

    Shard ids are the integer index of the piece in `output_sizes`.
    """


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q/k/v projection, sharded by heads. Shard ids are "q", "k", "v".

    Local output layout: [q heads of this rank | k heads of this rank | v heads of this rank].
    """

    _IDS = {"q": 0, "k": 1, "v": 2}

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool,
        dtype: torch.dtype,
        device="cpu",
    ) -> None:
        sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
        super().__init__(hidden_size, sizes, bias, dtype, device)

    def _shard_index(self, shard_id: object) -> int:
        if shard_id not in self._IDS:
            raise ValueError(f"QKV shard_id must be one of q/k/v, got {shard_id!r}")
        return self._IDS[shard_id]  # type: ignore[index]


class RowParallelLinear(nn.Module):
    """y = x W^T (+ b) with W split along the input dim; partial sums are all-reduced.

    The input is expected already split (the output of a column-parallel layer), so no scatter
    is needed. The bias is added once, after the reduction.
    """

    def __init__(
        self, input_size: int, output_size: int, bias: bool, dtype: torch.dtype, device="cpu"
    ) -> None:
        super().__init__()
        tp = get_tp_group()
        self.tp = tp
        self.tp_rank = tp.rank
        self.local_in = _divide(input_size, tp.world_size, "input size")
        self.weight = _empty_param(output_size, self.local_in, dtype=dtype, device=device)
        self.weight.weight_loader = self.weight_loader
        self.bias = _empty_param(output_size, dtype=dtype, device=device) if bias else None
        if self.bias is not None:
            self.bias.weight_loader = lambda p, t, shard_id=None: _copy_into(p, t)

    def weight_loader(self, param: nn.Parameter, full: torch.Tensor, shard_id=None) -> None:
        _copy_into(param, full.narrow(1, self.tp_rank * self.local_in, self.local_in))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return F.linear(x, self.weight, self.bias)
        out = self.tp.all_reduce(F.linear(x, self.weight))
        return out if self.bias is None else out + self.bias


class VocabParallelEmbedding(nn.Module):
    """Embedding table split along the vocab; each rank owns a contiguous range of token ids.

    The vocab is padded up to a multiple of the TP size so every shard has the same row count;
    padding rows are zero. Ids outside a rank's range produce zeros there, and the all-reduce
    sums exactly one non-zero contribution per token.
    """

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype, device="cpu") -> None:
        super().__init__()
        tp = get_tp_group()
        self.tp = tp
        self.vocab_size = vocab_size
        self.padded_vocab = math.ceil(vocab_size / tp.world_size) * tp.world_size
        self.rows_per_rank = self.padded_vocab // tp.world_size
        self.vocab_start = tp.rank * self.rows_per_rank
        self.vocab_end = self.vocab_start + self.rows_per_rank
        self.weight = _empty_param(self.rows_per_rank, hidden_size, dtype=dtype, device=device)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, full: torch.Tensor, shard_id=None) -> None:
        if full.shape[0] != self.vocab_size:
            raise ValueError(f"expected {self.vocab_size} vocab rows, got {full.shape[0]}")
        real_rows = max(0, min(self.vocab_end, self.vocab_size) - self.vocab_start)
        param.data.zero_()
        _copy_into_rows(param, full.narrow(0, self.vocab_start, real_rows), 0)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return F.embedding(input_ids, self.weight)
        in_range = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local_ids = (input_ids - self.vocab_start) * in_range  # out-of-range ids -> row 0
        out = F.embedding(local_ids, self.weight)
        out.masked_fill_(~in_range.unsqueeze(-1), 0)
        return self.tp.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection sharded like the embedding; logits are gathered to the full vocab."""

    def tie_to(self, embedding: VocabParallelEmbedding) -> None:
        # Both layers shard the vocab identically, so the local slices coincide.
        self.weight = embedding.weight

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden, self.weight)
        if self.tp.world_size > 1:
            logits = self.tp.all_gather(logits, dim=-1)
        if self.padded_vocab != self.vocab_size:
            logits = logits[..., : self.vocab_size]
        return logits.float()

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.compute_logits(hidden)


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
    """Neox-style RoPE ("rotate half") from a precomputed [positions, 2, head_dim] table.

    Row p holds cos(p*f) and a signed sin, so rotate_half(x) * sin == roll(x, D/2) * signed_sin
    and the rotation is three ops: x*cos, roll, addcmul. The table grows on demand (doubling),
    driven by the max sequence length known to the host, never by reading device tensors.
    """

    def __init__(
        self, head_dim: int, theta: float, scaling: dict | None, dtype: torch.dtype, device="cpu"
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.dtype = dtype
        # HF computes inverse frequencies in float32; do the same so positions match bit-for-bit
        # as closely as possible.
        self.inv_freq = rope_inv_freq(head_dim, theta, scaling).float().to(device)
        self.table = torch.empty(0, 2, head_dim, dtype=dtype, device=device)

    def _build(self, num_positions: int) -> None:
        pos = torch.arange(num_positions, dtype=torch.float32, device=self.inv_freq.device)
        freqs = torch.outer(pos, self.inv_freq)
        cos, sin = freqs.cos(), freqs.sin()
        table = torch.stack([torch.cat([cos, cos], -1), torch.cat([-sin, sin], -1)], dim=1)
        self.table = table.to(self.dtype)

    def lookup(self, positions: torch.Tensor, max_position: int) -> torch.Tensor:
        """Table rows for `positions` ([T, 2, D]); `max_position` bounds positions (host int)."""
        if max_position >= self.table.shape[0]:
            self._build(max(2 * self.table.shape[0], max_position + 1, 256))
        return self.table.index_select(0, positions)

    @staticmethod
    def apply_(x: torch.Tensor, cos_sin: torch.Tensor) -> None:
        """Rotate x [T, heads, D] in place (x may be a strided view into a fused qkv output)."""
        cos = cos_sin[:, 0:1]
        sin = cos_sin[:, 1:2]
        rolled = x.roll(x.shape[-1] // 2, dims=-1)
        torch.addcmul(x * cos, rolled, sin, out=x)
