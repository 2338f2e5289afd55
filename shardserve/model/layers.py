"""Tensor-parallel-ready building blocks: RMSNorm, sharded linears, sharded vocabulary.

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
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from shardserve.config.model_arch import kv_heads_of_rank
from shardserve.distributed.parallel_state import get_tp_group
from shardserve.model import native_kernels, quantization
from shardserve.model.matmul_layer import MatmulLayer
from shardserve.model.quantization import QuantizedTensor

if TYPE_CHECKING:
    from shardserve.model.lora import LoRAWeights

WeightLoader = Callable[[nn.Parameter, torch.Tensor, object], None]


def _empty_param(*shape: int, dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


def _weight_param(rows: int, cols: int, dtype: torch.dtype, device) -> nn.Parameter:
    """A [rows, cols] weight (HF [out, in] convention), stored column-major for float32.

    Measured on AVX-512 CPUs: for the batch-1 decode matvec, float32 `x @ W_t` with W_t
    contiguous [in, out] streams memory about 2x faster than `F.linear(x, W)`, while for bf16 and
    fp16 the row-major `F.linear` kernels are the fast ones (fp16 `x @ W_t` is far slower). The
    logical shape and values are the same either way; only `linear`/`embedding` look at strides.
    """
    if dtype == torch.float32:
        storage = torch.empty(cols, rows, dtype=dtype, device=device)
        return nn.Parameter(storage.t(), requires_grad=False)
    return _empty_param(rows, cols, dtype=dtype, device=device)


def embedding(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Rows of `weight` for `ids`; gathers columns of the storage when it is column-major (and
    returns them row-major: the first layer's norm and residual need dense rows)."""
    if weight.stride(-1) == 1:
        return F.embedding(ids, weight)
    return weight.t().index_select(1, ids.reshape(-1)).t().contiguous().view(*ids.shape, -1)


def _copy_into(param: nn.Parameter, src: torch.Tensor) -> None:
    if tuple(param.shape) != tuple(src.shape):
        raise ValueError(f"shape mismatch: parameter {tuple(param.shape)} vs {tuple(src.shape)}")
    param.data.copy_(src)  # copy_ also casts dtype and moves device


def _divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(
            f"{what}={numerator} is not divisible by tensor-parallel size {denominator}"
        )
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
        if self._native(x, residual):
            # The residual stream is updated in place: the caller's old residual is dead.
            out = native_kernels.rms_norm(x, self.weight, self.eps, residual)
            return out if residual is None else (out, residual)
        if residual is None:
            return F.rms_norm(x, self.shape, self.weight, self.eps)
        residual = x + residual
        return F.rms_norm(residual, self.shape, self.weight, self.eps), residual

    def _native(self, x: torch.Tensor, residual: torch.Tensor | None) -> bool:
        return (
            x.dim() == 2
            and x.stride(-1) == 1
            and (residual is None or residual.is_contiguous())
            and self.weight.dtype == x.dtype
            and native_kernels.supports(x.dtype, x.device)
        )


class ColumnParallelLinear(MatmulLayer):
    """y = x W^T (+ b) with W split along the output dim; each rank yields its output slice.

    `output_sizes` lists the full sizes of logically separate matrices stacked along the output
    dim (q/k/v, gate/up); each one is split evenly across ranks, so the local weight is the
    concatenation of every piece's local slice and one matmul computes them all. `local_rows`
    ((start, size) of this rank's rows of each full piece) overrides the even split: the K/V
    pieces of a QKV layer with more ranks than KV heads are replicated, not split.
    """

    lora: LoRAWeights | None = None  # adapter slots (model/lora.py), once enabled

    def __init__(
        self,
        input_size: int,
        output_sizes: Sequence[int],
        bias: bool,
        dtype: torch.dtype,
        device="cpu",
        local_rows: Sequence[tuple[int, int]] | None = None,
    ) -> None:
        super().__init__()
        tp = get_tp_group()
        self.tp_rank, self.tp_size = tp.rank, tp.world_size
        self.full_sizes = list(output_sizes)
        if local_rows is None:
            sizes = [_divide(n, self.tp_size, "output size") for n in output_sizes]
            local_rows = [(self.tp_rank * n, n) for n in sizes]
        # Per piece: where this rank's rows start in the full piece, and how many it holds.
        self.row_starts = [start for start, _ in local_rows]
        self.local_sizes = [size for _, size in local_rows]
        self.local_offsets = [sum(self.local_sizes[:i]) for i in range(len(self.local_sizes))]
        out_local = sum(self.local_sizes)
        self.weight = _weight_param(out_local, input_size, dtype, device)
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
        start, size = self.row_starts[idx], self.local_sizes[idx]
        if full.shape[0] != self.full_sizes[idx]:
            raise ValueError(f"expected {self.full_sizes[idx]} output rows, got {full.shape[0]}")
        if isinstance(full, QuantizedTensor):  # a matrix (GGUF biases are 1-D: never blocks)
            self.load_quantized(full.narrow_rows(start, size), self.local_offsets[idx])
            return
        local = full.narrow(0, start, size)
        _copy_into_rows(param, local, self.local_offsets[idx])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self._matmul(x, self.bias)
        return out if self.lora is None else self.lora.add_to(out, x)


def _copy_into_rows(param: nn.Parameter, src: torch.Tensor, offset: int) -> None:
    dst = param.data.narrow(0, offset, src.shape[0])
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"shape mismatch: slice {tuple(dst.shape)} vs {tuple(src.shape)}")
    dst.copy_(src)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel matrices fused into one matmul (e.g. gate_proj + up_proj).

    Shard ids are the integer index of the piece in `output_sizes`.
    """


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q/k/v projection, sharded by heads. Shard ids are "q", "k", "v".

    Local output layout: [q heads of this rank | k heads of this rank | v heads of this rank];
    `kv_head_ids` are the global KV heads of this rank (`kv_heads_of_rank`: one replicated
    head when there are more ranks than KV heads). With `rope_interleave`, q and k rows are
    stored in `rope_interleave_perm` order per head.
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
        rope_interleave: bool = False,
    ) -> None:
        sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
        tp = get_tp_group()
        q_rows = _divide(num_heads, tp.world_size, "num_heads") * head_dim
        kv_heads = kv_heads_of_rank(num_kv_heads, tp.world_size, tp.rank)
        kv_rows = (kv_heads[0] * head_dim, len(kv_heads) * head_dim)  # contiguous heads
        super().__init__(hidden_size, sizes, bias, dtype, device,
                         local_rows=[(tp.rank * q_rows, q_rows), kv_rows, kv_rows])
        self.kv_head_ids = kv_heads
        self.head_dim = head_dim
        self.rope_perm = rope_interleave_perm(head_dim) if rope_interleave else None

    def weight_loader(self, param: nn.Parameter, full: torch.Tensor, shard_id=None) -> None:
        if shard_id in ("q", "k"):
            full = self._rope_rows(full)
        super().weight_loader(param, full, shard_id)

    def _rope_rows(self, full: torch.Tensor | QuantizedTensor) -> torch.Tensor | QuantizedTensor:
        """q or k rows in this layer's order: with rope_perm, each head's rows reordered to
        interleaved RoPE pairs, unless they come so (a llama GGUF's blocks, used where they lie:
        see gguf_loader)."""
        interleaved = isinstance(full, QuantizedTensor) and full.rope_interleaved
        if interleaved and self.rope_perm is None:
            raise ValueError("q/k rows in interleaved RoPE order need rope_interleave=True")
        if self.rope_perm is None or interleaved:
            return full
        if isinstance(full, QuantizedTensor):
            heads = torch.arange(full.shape[0] // self.head_dim).unsqueeze(1)
            return full.index_rows((heads * self.head_dim + self.rope_perm).reshape(-1))
        heads = full.view(-1, self.head_dim, *full.shape[1:])
        return heads.index_select(1, self.rope_perm).reshape(full.shape)

    def _shard_index(self, shard_id: object) -> int:
        if shard_id not in self._IDS:
            raise ValueError(f"QKV shard_id must be one of q/k/v, got {shard_id!r}")
        return self._IDS[shard_id]  # type: ignore[index]


class RowParallelLinear(MatmulLayer):
    """y = x W^T (+ b) with W split along the input dim; partial sums are all-reduced.

    The input is expected already split (the output of a column-parallel layer), so no scatter
    is needed. The bias is added once, after the reduction.
    """

    lora: LoRAWeights | None = None  # adapter slots (model/lora.py), once enabled

    def __init__(
        self, input_size: int, output_size: int, bias: bool, dtype: torch.dtype, device="cpu"
    ) -> None:
        super().__init__()
        tp = get_tp_group()
        self.tp = tp
        self.tp_rank = tp.rank
        self.local_in = _divide(input_size, tp.world_size, "input size")
        self.weight = _weight_param(output_size, self.local_in, dtype, device)
        self.weight.weight_loader = self.weight_loader
        self.bias = _empty_param(output_size, dtype=dtype, device=device) if bias else None
        if self.bias is not None:
            self.bias.weight_loader = lambda p, t, shard_id=None: _copy_into(p, t)

    def weight_loader(self, param: nn.Parameter, full: torch.Tensor, shard_id=None) -> None:
        if isinstance(full, QuantizedTensor):
            if full.shape[0] != param.shape[0]:
                raise ValueError(f"expected {param.shape[0]} output rows, got {full.shape[0]}")
            self.load_quantized(full.narrow_cols(self.tp_rank * self.local_in, self.local_in), 0)
            return
        _copy_into(param, full.narrow(1, self.tp_rank * self.local_in, self.local_in))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            out = self._matmul(x, self.bias)
            return out if self.lora is None else self.lora.add_to(out, x)
        out = self._matmul(x, None)
        if self.lora is not None:  # a partial sum like the base product: before the reduce
            self.lora.add_to(out, x)
        out = self.tp.all_reduce(out)
        return out if self.bias is None else out + self.bias


class VocabParallelEmbedding(MatmulLayer):
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
        self.weight = _weight_param(self.rows_per_rank, hidden_size, dtype, device)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, full: torch.Tensor, shard_id=None) -> None:
        if full.shape[0] != self.vocab_size:
            raise ValueError(f"expected {self.vocab_size} vocab rows, got {full.shape[0]}")
        real_rows = max(0, min(self.vocab_end, self.vocab_size) - self.vocab_start)
        if isinstance(full, QuantizedTensor):
            self._load_quantized_rows(full, real_rows)
            return
        param.data.zero_()
        _copy_into_rows(param, full.narrow(0, self.vocab_start, real_rows), 0)

    def _load_quantized_rows(self, full: QuantizedTensor, real_rows: int) -> None:
        """This rank's rows of the table: where they are all real, a view of `full` (the file's
        blocks as they lie); else with zero padding rows (zero bytes decode to zeros in every
        kept type), copied."""
        if real_rows == self.rows_per_rank:
            self.load_quantized(full.narrow_rows(self.vocab_start, real_rows), 0)
            return
        data = torch.zeros(self.rows_per_rank, full.data.shape[1], dtype=torch.uint8)
        data[:real_rows] = full.data[self.vocab_start : self.vocab_start + real_rows]
        self.load_quantized(QuantizedTensor(data, full.ggml_type, full.cols), 0)

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self.qweight is None:
            return embedding(ids, self.weight)
        rows = quantization.dequantize_rows(self.qweight.segments[0][1], ids.reshape(-1),
                                            self.weight.dtype)
        return rows.view(*ids.shape, -1)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return self._lookup(input_ids)
        in_range = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local_ids = (input_ids - self.vocab_start) * in_range  # out-of-range ids -> row 0
        out = self._lookup(local_ids).contiguous()
        out.masked_fill_(~in_range.unsqueeze(-1), 0)
        return self.tp.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection sharded like the embedding; logits are gathered to the full vocab."""

    tied_to: VocabParallelEmbedding | None = None

    @property
    def tied(self) -> bool:
        return self.tied_to is not None

    def tie_to(self, embed: VocabParallelEmbedding) -> None:
        # Both layers shard the vocab identically, so the local slices coincide.
        self.weight = embed.weight
        # A plain attribute, not a registered submodule: the embedding belongs to the model.
        object.__setattr__(self, "tied_to", embed)

    def finalize_quantized(self, join_apart: bool = True, repack: bool = True) -> None:
        embed = self.tied_to
        if embed is not None and embed.qweight is not None:
            # The embedding (finalized first) holds the table; the head computes from it.
            self._set_qweight(embed.qweight)
            return
        super().finalize_quantized(join_apart, repack)

    def pack_weight(self, keep_dense: bool = False) -> None:
        # A tied table must stay dense for the embedding lookup, so packing costs a copy.
        super().pack_weight(keep_dense=keep_dense or self.tied)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self._matmul(hidden, None, out_dtype=torch.float32)
        if self.tp.world_size > 1:
            logits = self.tp.all_gather(logits, dim=-1)
        if self.padded_vocab != self.vocab_size:
            logits = logits[..., : self.vocab_size]
        return logits.float()

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.compute_logits(hidden)


def rope_interleave_perm(head_dim: int) -> torch.Tensor:
    """Row order that turns HF's "rotate half" pairs (j, j + D/2) into adjacent pairs (2j, 2j+1).

    Applied to the q and k projection rows of every head at load time. Attention scores only
    use q . k, which is invariant to permuting q and k the same way, so the model is unchanged,
    but the rotation becomes one in-place complex multiply on adjacent pairs.
    """
    half = head_dim // 2
    return torch.stack([torch.arange(half), torch.arange(half) + half], dim=1).reshape(-1)
