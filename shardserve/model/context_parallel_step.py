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
class DecodeContextStep:
    """DCP: this rank's part of a step whose KV is sharded by position (see module docstring)."""

    group: GroupCoordinator
    owned_rows: torch.Tensor  # int64 rows of the flat batch whose position this rank owns
    owned_slots: torch.Tensor  # int64 their local cache slots
    row_req: torch.Tensor  # int64 [T] request row of block_table of each flat row
    num_visible: torch.Tensor  # int64 [T] local keys each row attends (a prefix, causal)
    block_table: torch.Tensor  # int64 [R, W]
    kv_select: torch.Tensor | None  # gathered KV heads the group stores (None: all, in order)

    def attention(self, q: torch.Tensor, kv: torch.Tensor, kv_cache: torch.Tensor,
                  meta: AttentionMetadata) -> torch.Tensor:
        t, local_heads, head_dim = q.shape
        me = self.group.rank
        q_all = self.group.all_gather(q, dim=1)
        kv_all = self.group.all_gather(kv, dim=2)
        if self.kv_select is not None:
            kv_all = kv_all.index_select(2, self.kv_select)
        if self.owned_rows.numel():
            write_kv(kv_cache, kv_all.index_select(0, self.owned_rows).contiguous(),
                     self.owned_slots)
        out, lse = partial_attention(q_all.contiguous(), kv_cache, self.block_table,
                                     self.row_req, self.num_visible, head_dim ** -0.5)
        packed = torch.cat([out, lse.unsqueeze(-1)], dim=-1)  # [T, n*Hl, D + 1]
        parts = self.group.all_gather(packed.unsqueeze(0), dim=0)  # [n, T, n*Hl, D + 1]
        mine = parts[:, :, me * local_heads:(me + 1) * local_heads]
        merged = merge_partials(mine[..., :head_dim].contiguous(),
                                mine[..., head_dim].contiguous())
        return merged.to(q.dtype).reshape(t, local_heads * head_dim)


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
