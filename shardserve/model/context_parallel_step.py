"""One step's context-parallel attention: what a layer's attention does instead of writing its
own K/V and attending its own queries (the math and kernels: context_parallel.py).

Decode context parallel (DCP, within a TP group): the n ranks of a DCP group hold the same
tokens, each its own heads. A request's K/V is sharded by position (position p on rank
owner(p) only), over all the group's KV heads:

    rank m:  q [T, Hl, D], kv [T, 2, Hkvl, D]          (its own heads)
      all-gather q and kv over the group (heads axis) -> q [T, n*Hl, D], kv [T, 2, Kg, D]
      write the rows it owns at their local slots
      partial attention of every row and head over its shard -> out [T, n*Hl, D], lse [T, n*Hl]
      all-gather (out | lse) over the group            -> [n, T, n*Hl, D + 1]
      merge the n partials of its own heads (exact LSE rescale) -> [T, Hl*D]

Prefill context parallel (PCP): the ranks of a PCP group compute different tokens of a prompt
(the runner split it: worker/context_parallel_inputs.py) and each holds the whole KV cache:

    rank r:  write its own rows' K/V; all-gather the K/V of the rows the other ranks need
             (every rank's split rows, padded to one length) and write the other ranks' ones;
             then attend its own rows as usual (their context is now in the cache).

Ordering: every layer writes before it attends, on every rank, so a row's context is complete;
each collective is called by every rank of its group in the same layer order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardserve.distributed.parallel_state import GroupCoordinator
from shardserve.model.attention import AttentionMetadata, attend, write_kv
from shardserve.model.context_parallel import merge_partials, partial_attention


@dataclass
class ShardRows:
    """A step's rows against this rank's shard of the KV cache (DCP)."""

    owned_rows: torch.Tensor  # int64 rows of the step whose position this rank owns
    owned_slots: torch.Tensor  # int64 their local cache slots
    row_req: torch.Tensor  # int64 [T] request row of block_table of each row
    num_visible: torch.Tensor  # int64 [T] local keys each row attends (a prefix, causal)
    block_table: torch.Tensor  # int64 [R, W]

    def write_and_attend(self, q: torch.Tensor, kv: torch.Tensor, kv_cache: torch.Tensor
                         ) -> torch.Tensor:
        """Store the owned rows of kv [T, 2, Hkv, D]; every row's partial attention over the
        shard, packed as (out | lse): [T, H, D + 1] float32."""
        if self.owned_rows.numel():
            write_kv(kv_cache, kv.index_select(0, self.owned_rows).contiguous(),
                     self.owned_slots)
        out, lse = partial_attention(q.contiguous(), kv_cache, self.block_table, self.row_req,
                                     self.num_visible, q.shape[-1] ** -0.5)
        return torch.cat([out, lse.unsqueeze(-1)], dim=-1)


def _merge_packed(parts: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[n, T, H, D + 1] packed partials of n shards -> [T, H * D] in `dtype`."""
    n, t, heads, d1 = parts.shape
    merged = merge_partials(parts[..., :d1 - 1].contiguous(), parts[..., d1 - 1].contiguous())
    return merged.to(dtype).reshape(t, heads * (d1 - 1))


@dataclass
class DecodeContextStep:
    """DCP: this rank's part of a step whose KV is sharded by position (see module docstring)."""

    group: GroupCoordinator
    rows: ShardRows
    kv_select: torch.Tensor | None  # gathered KV heads the group stores (None: all, in order)

    def attention(self, q: torch.Tensor, kv: torch.Tensor, kv_cache: torch.Tensor,
                  meta: AttentionMetadata) -> torch.Tensor:
        local_heads, me = q.shape[1], self.group.rank
        q_all = self.group.all_gather(q, dim=1)
        kv_all = self.group.all_gather(kv, dim=2)
        if self.kv_select is not None:
            kv_all = kv_all.index_select(2, self.kv_select)
        packed = self.rows.write_and_attend(q_all, kv_all, kv_cache)  # [T, n*Hl, D + 1]
        parts = self.group.all_gather(packed.unsqueeze(0), dim=0)  # [n, T, n*Hl, D + 1]
        return _merge_packed(parts[:, :, me * local_heads:(me + 1) * local_heads], q.dtype)


@dataclass
class PrefillContextStep:
    """PCP: this rank's rows plus the K/V of the rows the other ranks computed."""

    group: GroupCoordinator
    send_rows: torch.Tensor  # int64 local rows of split prompts (what the others need)
    max_rows: int  # every rank's send rows padded to this many
    recv_index: torch.Tensor  # int64 rows of the gathered [P * max_rows] to write here
    recv_slots: torch.Tensor  # int64 their cache slots

    def gather_rows(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's send rows of x [T_local, ...], padded: [P * max_rows, ...]."""
        send = x.new_zeros((self.max_rows, *x.shape[1:]))
        send[: self.send_rows.numel()] = x.index_select(0, self.send_rows)
        return self.group.all_gather(send, dim=0)

    def attention(self, q: torch.Tensor, kv: torch.Tensor, kv_cache: torch.Tensor,
                  meta: AttentionMetadata) -> torch.Tensor:
        write_kv(kv_cache, kv, meta.slot_mapping)
        gathered = self.gather_rows(kv)
        if self.recv_index.numel():
            write_kv(kv_cache, gathered.index_select(0, self.recv_index).contiguous(),
                     self.recv_slots)
        return attend(q, kv, kv_cache, meta)


@dataclass
class ShardedPrefillStep:
    """PCP with DCP over the context shards (dcp = pcp), or over TP x PCP: the context shards
    compute different rows and each rank stores only the positions it owns, of every row.

    rank r:  rejoin the full step's q and K/V (its own rows, the others' split rows gathered)
             (dcp = TP x PCP: and all-gather them over the TP group's heads)
             write the full step's rows it owns at their local slots
             partial attention of every row of the full step over its shard
             all-gather (out | lse) over the DCP group; merge the partials of its own rows
             (and heads)
    Every rank attends 1/dcp of every row's keys, so the work is even whatever the split.
    """

    rejoin: PrefillContextStep | None  # the split rows' gather (None: no row split)
    group: GroupCoordinator  # the DCP group
    local_index: torch.Tensor  # int64 [T_local] full-step row of each local row
    recv_full: torch.Tensor  # int64 full-step rows of rejoin.recv_index
    num_full: int
    shard: ShardRows  # the full step's rows against this rank's shard
    heads: GroupCoordinator | None = None  # dcp = TP x PCP: the TP group, whose heads it joins
    kv_select: torch.Tensor | None = None  # which gathered KV heads the cache holds

    def _full(self, x: torch.Tensor) -> torch.Tensor:
        if self.rejoin is None:  # every rank holds every row
            return x.contiguous()
        full = x.new_empty((self.num_full, *x.shape[1:]))
        full[self.local_index] = x
        gathered = self.rejoin.gather_rows(x)
        full[self.recv_full] = gathered.index_select(0, self.rejoin.recv_index)
        return full

    def attention(self, q: torch.Tensor, kv: torch.Tensor, kv_cache: torch.Tensor,
                  meta: AttentionMetadata) -> torch.Tensor:
        q_full, kv_full = self._full(q), self._full(kv)
        local_heads = q.shape[1]
        if self.heads is not None:
            q_full = self.heads.all_gather(q_full, dim=1)
            kv_full = self.heads.all_gather(kv_full, dim=2)
            if self.kv_select is not None:
                kv_full = kv_full.index_select(2, self.kv_select)
        packed = self.shard.write_and_attend(q_full, kv_full, kv_cache)
        parts = self.group.all_gather(packed.unsqueeze(0), dim=0)  # [n, N_full, Hg, D + 1]
        mine = parts.index_select(1, self.local_index)
        if self.heads is not None:
            first = self.heads.rank * local_heads
            mine = mine[:, :, first:first + local_heads]
        return _merge_packed(mine, q.dtype)
