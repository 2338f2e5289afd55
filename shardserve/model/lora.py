"""LoRA on the model's projections: per adapted layer a stack of `max_loras` adapter slots, and
one `LoRABatch` per model saying which slot each token of the step reads.

    out = base(x)                          # the layer's own product, dense or quantized
    out[rows of slot s] += (x[rows] @ A[s]^T) @ B[s]^T      for every slot s in the step

Slots hold an adapter's weights already in this layer's form (worker/lora_manager.py writes
them): the merged layers stack their sub-projections (qkv_proj: q|k|v, gate_up_proj: gate|up)
with each sub's A along the rank axis (R_total = subs x max_lora_rank) and B block-diagonal, so
one pair of matmuls serves the whole fused layer; the scaling is folded into B; a smaller rank
is zero-padded. Tensor parallelism shards an adapter like the layer it adapts (see
`shard_column` / `shard_row`); q and k rows of B are put in the layer's RoPE-interleaved order.

The add is grouped by slot (every token of one adapter in one pair of matmuls), never per
token, and tokens of the base model (slot -1) are not touched. `LoRAWeights.add_to` is the one
place the layers compute it: one C call for all slots on CPUs (csrc/lora_kernels.c, which the
fused decode step calls too), torch grouped by slot elsewhere. B is kept transposed (`bt`
[slots, R_total, N], `b` its [slots, N, R_total] view) for the kernel's unit-stride expand.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from shardserve.model import native_kernels
from shardserve.model.layers import (
    ColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    rope_interleave_perm,
)

# Per decoder layer: our module path -> the HF projections it fuses, in its row order.
ADAPTED = (
    ("self_attn.qkv_proj", ("q_proj", "k_proj", "v_proj")),
    ("self_attn.o_proj", ("o_proj",)),
    ("mlp.gate_up_proj", ("gate_proj", "up_proj")),
    ("mlp.down_proj", ("down_proj",)),
)

Rows = slice | torch.Tensor


class LoRABatch:
    """The step's per-token adapter slots, shared by every adapted layer of a model.

    `slots` is int32 [num_tokens] (-1: the base model) or None when no token has an adapter;
    `groups` lists (slot, rows) once per slot in the step, rows a slice where its tokens are
    contiguous (the usual case: one request's tokens are adjacent) else an index tensor."""

    def __init__(self) -> None:
        self.slots: torch.Tensor | None = None
        self._cpu_slots: torch.Tensor | None = None
        self._groups: list[tuple[int, Rows]] | None = []

    @property
    def active(self) -> bool:
        return self.slots is not None

    def set(self, slots: Sequence[int] | torch.Tensor | None,
            device: torch.device | str = "cpu") -> None:
        """Use `slots` (one per token of the next forward) until the next call; None or all
        -1: a base-only step."""
        self.slots, self._cpu_slots, self._groups = None, None, []
        if slots is None:
            return
        t = torch.as_tensor(slots, dtype=torch.int32).cpu()
        if t.numel() and bool((t >= 0).any()):
            self.slots, self._cpu_slots, self._groups = t.to(device), t, None

    @property
    def groups(self) -> list[tuple[int, Rows]]:
        """Worked out on first use (the C kernel reads `slots` alone)."""
        if self._groups is None:
            t, device = self._cpu_slots, self.slots.device  # type: ignore[union-attr]
            assert t is not None
            self._groups = []
            for slot in [int(s) for s in torch.unique(t) if s >= 0]:
                idx = (t == slot).nonzero().squeeze(1)
                first, last = int(idx[0]), int(idx[-1])
                rows: Rows = slice(first, last + 1) if last - first + 1 == idx.numel() else \
                    idx.to(device)
                self._groups.append((slot, rows))
        return self._groups


@dataclass(frozen=True)
class SubShard:
    """One sub-projection of one adapter as this rank's layer uses it: A [r, K_local] and
    B [N_sub_local, r] with the scaling folded in, in the LoRA dtype."""

    a: torch.Tensor
    b: torch.Tensor


def shard_column(a: torch.Tensor, b: torch.Tensor, start: int, rows: int,
                 rope_head_dim: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A column-parallel layer's adapter: B's rows [start, start + rows), the layer's own rows
    of that piece (`row_starts` / `local_sizes`: a split, or the replicated K/V head of a
    QKV layer with more ranks than KV heads), after the RoPE row order of q/k as the layer's
    weight loader does; A whole (its input is whole on every rank)."""
    if rope_head_dim is not None:
        perm = rope_interleave_perm(rope_head_dim)
        b = b.view(-1, rope_head_dim, b.shape[1]).index_select(1, perm).reshape(b.shape)
    return a, b.narrow(0, start, rows)


def shard_row(a: torch.Tensor, b: torch.Tensor, tp_rank: int,
              tp_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A row-parallel layer's adapter: A's columns split like the layer's input (each rank
    holds its slice of x), B whole; each rank's x_r A_r^T B^T is a partial sum of the full
    product, added before the layer's all-reduce."""
    cols = a.shape[1] // tp_size
    return a.narrow(1, tp_rank * cols, cols), b


class LoRAWeights:
    """The adapter slots of one projection layer, and the add of the step's adapters."""

    def __init__(self, layer: ColumnParallelLinear | RowParallelLinear, names: tuple[str, ...],
                 max_loras: int, max_rank: int, dtype: torch.dtype, batch: LoRABatch) -> None:
        self.names, self.max_rank, self.dtype, self.batch = names, max_rank, dtype, batch
        self.column = isinstance(layer, ColumnParallelLinear)
        if self.column:
            assert isinstance(layer, ColumnParallelLinear)
            self.tp_rank, self.tp_size = layer.tp_rank, layer.tp_size
            out_sizes = list(layer.local_sizes)
            self.row_starts = list(layer.row_starts)
            in_local = layer.weight.shape[1]
        else:
            assert isinstance(layer, RowParallelLinear)
            self.tp_rank, self.tp_size = layer.tp_rank, layer.tp.world_size
            out_sizes, in_local = [layer.weight.shape[0]], layer.local_in
        if len(out_sizes) != len(names):
            raise ValueError(f"{type(layer).__name__} has {len(out_sizes)} pieces, "
                             f"names {names} has {len(names)}")
        head_dim = layer.head_dim if isinstance(layer, QKVParallelLinear) and \
            layer.rope_perm is not None else None
        self.rope_head_dims = [head_dim if n in ("q_proj", "k_proj") else None for n in names]
        self.out_sizes = out_sizes
        self.out_offsets = [sum(out_sizes[:i]) for i in range(len(out_sizes))]
        device = layer.weight.device
        r_total = len(names) * max_rank
        # A and B are stored transposed, [S, K, R] and [S, R, N]: the C kernel's products are
        # then sums of weight rows with unit stride along the output (csrc/lora_kernels.c);
        # `a` [S, R, K] and `b` [S, N, R] are the views the writers and the torch path use.
        self.at = torch.zeros(max_loras, in_local, r_total, dtype=dtype, device=device)
        self.a = self.at.transpose(1, 2)
        self.bt = torch.zeros(max_loras, r_total, sum(out_sizes), dtype=dtype, device=device)
        self.b = self.bt.transpose(1, 2)
        self.seg_ends = torch.tensor([o + n for o, n in zip(self.out_offsets, out_sizes,
                                                            strict=True)], dtype=torch.int64)

    def shard(self, subs: Sequence[tuple[torch.Tensor, torch.Tensor, float] | None]
              ) -> list[SubShard | None]:
        """This rank's slices of full HF (A [r, in], B [out, r], scaling) per sub-projection
        (None: the adapter leaves that one alone), scaled and cast for `write`."""
        out: list[SubShard | None] = []
        for i, sub in enumerate(subs):
            if sub is None:
                out.append(None)
                continue
            a, b, scaling = sub
            if self.column:
                a, b = shard_column(a, b, self.row_starts[i], self.out_sizes[i],
                                    self.rope_head_dims[i])
            else:
                a, b = shard_row(a, b, self.tp_rank, self.tp_size)
            out.append(SubShard(a.to(self.dtype).contiguous(),
                                (b * scaling).to(self.dtype).contiguous()))
        return out

    def write(self, slot: int, shards: Sequence[SubShard | None]) -> None:
        """Put one adapter's shards into `slot` (whatever was there before is gone)."""
        a, b = self.a[slot], self.b[slot]
        a.zero_()
        b.zero_()
        for i, sh in enumerate(shards):
            if sh is None:
                continue
            r, lo = sh.a.shape[0], i * self.max_rank
            a[lo:lo + r].copy_(sh.a)
            b[self.out_offsets[i]:self.out_offsets[i] + self.out_sizes[i], lo:lo + r].copy_(sh.b)

    def add_to(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """out += the step's adapters' x A^T B^T, one pair of matmuls per slot; returns out.
        On CPUs one C call does every slot (the same sums whatever the batch; the fused decode
        step calls the same kernel, so both paths agree bit for bit)."""
        slots = self.batch.slots
        if slots is None:
            return out
        if slots.shape[0] != x.shape[0]:  # the kernel would read past the slots
            raise ValueError(f"the LoRA batch has {slots.shape[0]} token slots but the layer "
                             f"got {x.shape[0]} rows: prepare() takes the step's token counts")
        if self._native(out, x, slots):
            native_kernels.lora_add_(out, x, slots, self.at, self.bt, self.seg_ends)
            return out
        for slot, rows in self.batch.groups:
            xs = x[rows]
            if xs.dtype != self.dtype:
                xs = xs.to(self.dtype)
            delta = torch.matmul(torch.matmul(xs, self.a[slot].t()), self.b[slot].t())
            if isinstance(rows, slice):
                out[rows] += delta.to(out.dtype)
            else:
                out.index_add_(0, rows, delta.to(out.dtype))
        return out

    def _native(self, out: torch.Tensor, x: torch.Tensor, slots: torch.Tensor) -> bool:
        return (out.dim() == 2 and x.dim() == 2 and out.stride(1) == 1 and x.stride(1) == 1
                and x.dtype == out.dtype and self.dtype in (torch.float32, torch.bfloat16)
                and slots.device.type == "cpu" and native_kernels.supports(out.dtype, out.device))


def attach(layers: nn.ModuleList, first_layer: int, max_loras: int, max_rank: int,
           dtype: torch.dtype) -> tuple[LoRABatch, dict[int, dict[str, LoRAWeights]]]:
    """Give every adapted projection of `layers` (decoder layers numbered from `first_layer`)
    its slots, all reading one new LoRABatch; returns the batch and, per global layer index,
    the slots by module path."""
    batch = LoRABatch()
    table: dict[int, dict[str, LoRAWeights]] = {}
    for i, layer in enumerate(layers):
        entry = table.setdefault(first_layer + i, {})
        for path, names in ADAPTED:
            module = layer.get_submodule(path)
            module.lora = LoRAWeights(module, names, max_loras, max_rank, dtype, batch)
            entry[path] = module.lora
    return batch, table
