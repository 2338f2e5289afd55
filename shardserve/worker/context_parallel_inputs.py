"""A step's context-parallel inputs on this rank (attention's side: model/context_parallel_step.py).

The runner lays a step out as today (the full step: every scheduled token, its rows for
attention); with context parallelism this module derives what this rank runs instead.

Decode context parallel (DCP, dcp > 1): the same tokens on every rank of the DCP group; the
scheduler's block tables count virtual blocks of block_size x dcp tokens, and the step gets a
`DecodeContextStep`: which rows this rank stores (owner(p) = its DCP rank), at which local slots,
and how many of its local keys each row sees. The cache holds the group's KV heads.

Prefill context parallel (PCP, pcp > 1): a request row of >= 2 x pcp tokens (a prefill or a
chunk of one) is split into 2 x pcp chunks; this rank computes chunks r and 2 x pcp - 1 - r as
two attention rows (query_len = the chunk, seq_len = its end), the other rows (decodes, short
prefills) are computed on every rank as without PCP:

    full step  [ decode a | prefill b: c0 c1 c2 c3 | decode d ]     (pcp = 2)
    rank 0     [ decode a | c0 | c3 | decode d ]
    rank 1     [ decode a | c1 | c2 | decode d ]

The split rows' K/V are all-gathered in every layer (PrefillContextStep), and the final hidden
states once at the end (`PrefillSplit.gather_hidden`: split rows from the rank that computed
them, duplicated rows from rank 0), so that every rank holds the same full step's hidden states
in order for logits, prompt logprobs and pooling, and samples the same tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from shardserve.config import EngineConfig
from shardserve.config.model_arch import kv_heads_of_rank
from shardserve.distributed.parallel_state import GroupCoordinator
from shardserve.model.attention import AttentionMetadata, pad_block_tables
from shardserve.model.context_parallel import ContextShards, rank_token_indices
from shardserve.model.context_parallel_step import (
    DecodeContextStep,
    PrefillContextStep,
    ShardedPrefillStep,
    ShardRows,
)


@dataclass
class Rows:
    """Attention rows of a step: (query_len, seq_len, block table) each, in flat order."""

    query_lens: list[int]
    seq_lens: list[int]
    block_tables: list[list[int]]


@dataclass(frozen=True)
class DcpHeads:
    """The KV heads a DCP group stores (each once) and which gathered heads they are."""

    heads: list[int]  # global KV head ids, in the cache's order
    select: list[int] | None  # index into the all-gathered heads; None: all of them, in order

    @classmethod
    def of_group(cls, num_heads: int, num_kv_heads: int, tp: int, tp_ranks: list[int]
                 ) -> DcpHeads:
        gathered = [h for r in tp_ranks for h in kv_heads_of_rank(num_kv_heads, tp, r)]
        heads = sorted(set(gathered))
        select = [gathered.index(h) for h in heads]
        # The kernels read KV head h // G for query head h of the gathered heads: true when
        # the group's query heads are exactly those of its KV heads, in order.
        group = num_heads // num_kv_heads
        first_q = tp_ranks[0] * (num_heads // tp)
        if heads != list(range(heads[0], heads[-1] + 1)) or first_q // group != heads[0]:
            raise ValueError(f"decode context parallel group of TP ranks {tp_ranks} holds KV "
                             f"heads {gathered}: not a contiguous block of its query heads")
        return cls(heads, None if select == list(range(len(gathered))) else select)


def shard_rows(shards: ContextShards, meta: AttentionMetadata, rows: Rows) -> ShardRows:
    """The full step's rows against this rank's shard, from its metadata (virtual blocks)."""
    q = torch.tensor(rows.query_lens, dtype=torch.int64)
    row_req = torch.repeat_interleave(torch.arange(len(q)), q)
    positions = meta.positions.cpu()
    table = pad_block_tables(rows.block_tables)
    owned = torch.nonzero(shards.owner(positions) == shards.rank).flatten()
    local = shards.local_index(positions[owned])
    bs = shards.block_size
    slots = table[row_req[owned], local // bs] * bs + local % bs
    device = meta.positions.device
    return ShardRows(owned_rows=owned.to(device), owned_slots=slots.to(device),
                     row_req=row_req.to(device),
                     num_visible=shards.num_local(positions + 1).to(device),
                     block_table=table.to(device))


@dataclass
class PrefillSplit:
    """What this PCP rank runs of a step, and how its results rejoin the full step."""

    group: GroupCoordinator
    local_index: torch.Tensor  # int64 [T_local] full-step row of each local row
    rows: Rows  # this rank's attention rows
    step: PrefillContextStep | None  # None: no row split, every rank runs the whole step
    recv_full: torch.Tensor  # int64 full-step rows of step.recv_index (the others' rows)
    dup_local: torch.Tensor  # int64 local rows every rank computes (not split)

    def gather_hidden(self, hidden: torch.Tensor, num_full: int) -> torch.Tensor:
        """The full step's hidden states [num_full, H] from this rank's [T_local, H], the same
        on every rank of the group: split rows from the rank that computed them, the others
        from rank 0 (a rank's own copy of a duplicated row may round differently: its batch
        differs), so every rank samples the same tokens from the same logits."""
        full = hidden.new_empty((num_full, hidden.shape[1]))
        full[self.local_index] = hidden
        if self.step is not None:
            gathered = self.step.gather_rows(hidden)
            full[self.recv_full] = gathered.index_select(0, self.step.recv_index)
        n = self.dup_local.numel()
        if n:
            copies = self.group.all_gather(hidden.index_select(0, self.dup_local), dim=0)
            full[self.local_index[self.dup_local]] = copies[:n]
        return full


def split_prefills(group: GroupCoordinator, rows: Rows, full_slots: torch.Tensor,
                   device: torch.device) -> PrefillSplit:
    """This rank's part of a step (see the module docstring)."""
    pcp, me = group.world_size, group.rank
    offsets = np.cumsum([0, *rows.query_lens])
    split = [i for i, n in enumerate(rows.query_lens) if n >= 2 * pcp]
    local_index, mine, dup_local = _local_rows(rows, offsets, set(split), pcp, me)
    as_t = lambda a: torch.from_numpy(np.asarray(a, dtype=np.int64)).to(device)  # noqa: E731
    if not split:
        return PrefillSplit(group, as_t(local_index), mine, None, as_t([]), as_t(dup_local))
    per_rank = [np.concatenate([offsets[i] + rank_token_indices(rows.query_lens[i], pcp, k)
                                for i in split]) for k in range(pcp)]
    max_rows = max(len(r) for r in per_rank)
    recv_full = np.concatenate([per_rank[k] for k in range(pcp) if k != me])
    recv_index = np.concatenate([k * max_rows + np.arange(len(per_rank[k]))
                                 for k in range(pcp) if k != me])
    local_pos = {int(f): j for j, f in enumerate(local_index)}
    send_rows = np.array([local_pos[int(f)] for f in per_rank[me]], dtype=np.int64)
    step = PrefillContextStep(group, as_t(send_rows), max_rows, as_t(recv_index),
                              full_slots.index_select(0, as_t(recv_full).to(full_slots.device)))
    return PrefillSplit(group, as_t(local_index), mine, step, as_t(recv_full), as_t(dup_local))


def _local_rows(rows: Rows, offsets: np.ndarray, split: set[int], pcp: int, me: int
                ) -> tuple[np.ndarray, Rows, np.ndarray]:
    """This rank's full-step rows, its attention rows (split rows as their two chunks), and
    which of its rows are duplicated (computed by every rank)."""
    index: list[np.ndarray] = []
    dup: list[np.ndarray] = []
    mine = Rows([], [], [])
    done = 0
    for i, (n, s, table) in enumerate(zip(rows.query_lens, rows.seq_lens, rows.block_tables,
                                          strict=True)):
        if i not in split:
            index.append(offsets[i] + np.arange(n))
            dup.append(done + np.arange(n))
            done += n
            mine.query_lens.append(n)
            mine.seq_lens.append(s)
            mine.block_tables.append(table)
            continue
        idx = rank_token_indices(n, pcp, me)
        index.append(offsets[i] + idx)
        done += len(idx)
        # The chunks are runs of idx: cut where consecutive indices jump.
        for run in np.split(idx, np.nonzero(np.diff(idx) != 1)[0] + 1):
            mine.query_lens.append(len(run))
            mine.seq_lens.append(s - n + int(run[-1]) + 1)
            mine.block_tables.append(table)
    return np.concatenate(index), mine, np.concatenate(dup) if dup else np.zeros(0, np.int64)


class ContextParallel:
    """This rank's context parallelism, built once; it runs each step's forward."""

    def __init__(self, pcp: GroupCoordinator, dcp: GroupCoordinator,
                 shards: ContextShards | None, heads: DcpHeads | None,
                 virtual_block_size: int, tp: GroupCoordinator, device: torch.device) -> None:
        self.pcp, self.dcp, self.tp = pcp, dcp, tp
        self.shards, self.heads = shards, heads
        self.virtual_block_size = virtual_block_size  # the scheduler's tables' blocks
        # Which of the all-gathered KV heads the cache keeps (None: all, or no gather).
        self.kv_select = None if heads is None or heads.select is None \
            else torch.tensor(heads.select, device=device)

    @classmethod
    def build(cls, config: EngineConfig, tp: GroupCoordinator,
              pcp: GroupCoordinator, dcp: GroupCoordinator, device: torch.device
              ) -> ContextParallel | None:
        pc = config.parallel_config
        if not pc.context_parallel:
            return None
        shards = heads = None
        if dcp.world_size > 1:
            shards = ContextShards(size=dcp.world_size, rank=dcp.rank,
                                   interleave=pc.cp_kv_cache_interleave_size,
                                   block_size=config.cache_config.block_size)
        arch = config.model_config.arch
        if dcp.world_size > 1 and pcp.world_size == 1:  # within a TP group: consecutive ranks
            first = tp.rank - dcp.rank
            heads = DcpHeads.of_group(arch.num_heads, arch.num_kv_heads, tp.world_size,
                                      list(range(first, first + dcp.world_size)))
        elif dcp.world_size > pcp.world_size:  # over TP x PCP: every head of the TP group
            heads = DcpHeads.of_group(arch.num_heads, arch.num_kv_heads, tp.world_size,
                                      list(range(tp.world_size)))
        return cls(pcp, dcp, shards, heads, config.virtual_block_size, tp, device)

    def cache_kv_heads(self, local_num_kv_heads: int) -> int:
        return local_num_kv_heads if self.heads is None else len(self.heads.heads)

    def forward(self, run: Callable[[torch.Tensor, AttentionMetadata], torch.Tensor | None],
                input_ids: torch.Tensor, meta: AttentionMetadata, rows: Rows
                ) -> torch.Tensor | None:
        """run(input_ids, meta) on this rank's part of the full step `meta`/`rows`; the full
        step's hidden states (None on a stage that is not the last)."""
        if self.pcp.world_size == 1:  # DCP within TP: every rank runs the whole step
            assert self.shards is not None
            meta.context = DecodeContextStep(self.dcp, shard_rows(self.shards, meta, rows),
                                             self.kv_select)
            return run(input_ids, meta)
        split = split_prefills(self.pcp, rows, meta.slot_mapping, input_ids.device)
        if self.shards is not None:  # DCP over the context shards (and TP)
            local = self._local_meta(split, meta, input_ids.device)
            local.context = ShardedPrefillStep(split.step, self.dcp, split.local_index,
                                               split.recv_full, meta.num_tokens,
                                               shard_rows(self.shards, meta, rows),
                                               None if self.heads is None else self.tp,
                                               self.kv_select)
        elif split.step is None:  # nothing split: every rank runs the whole step
            local = meta
        else:
            local = self._local_meta(split, meta, input_ids.device)
            local.context = split.step
        hidden = run(input_ids if split.step is None  # no row split: every row, in order
                     else input_ids.index_select(0, split.local_index), local)
        return None if hidden is None else split.gather_hidden(hidden, meta.num_tokens)

    def _local_meta(self, split: PrefillSplit, meta: AttentionMetadata, device: torch.device
                    ) -> AttentionMetadata:
        if split.step is None:
            return meta
        # Each chunk its own attention group: a rank's two chunks of a prompt end far apart,
        # and one padded group would give the early one the late one's context.
        r = split.rows
        return AttentionMetadata.build(r.query_lens, r.seq_lens, r.block_tables,
                                       self.virtual_block_size, device, prefill_per_row=True)
