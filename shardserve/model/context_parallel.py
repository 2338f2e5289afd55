"""Context parallelism: who owns which token's K/V, how a prompt is split, and the attention of
one rank over its shard with the exact merge of the shards' partials (issue 29). Pure math and
kernels: the collectives around them are model/context_parallel_step.py's.

Decode context parallel (DCP): the dcp ranks of a group hold the same requests, and position p
of a request is stored only on rank owner(p). The scheduler counts VIRTUAL blocks of
V = bs * dcp tokens; a virtual block id b is, on every rank, the id of a PHYSICAL block of bs
slots. Inside a virtual block, runs of I (the interleave size) positions go to the ranks in turn:

    dcp = 2, I = 2, bs = 4 (V = 8):      virtual block 0             virtual block 1
    position p                   0 1 2 3 4 5 6 7       8 9 10 11 12 13 14 15
    owner(p)                     0 0 1 1 0 0 1 1       0 0  1  1  0  0  1  1
    local index j(p) on owner    0 1 0 1 2 3 2 3       4 5  4  5  6  7  6  7
    local slot                   table[j // bs] * bs + j % bs   (physical block table[b])

    o = p % V;  owner(p) = (o // I) % dcp;  j(p) = (p // V) * bs + (o // (I * dcp)) * I + o % I

A rank's local indices are dense and increase with p, so the keys a query at position q may see
on rank m are the prefix j < num_local(q + 1, m): a causal limit is one number per row and rank.
I = 1 spreads consecutive tokens over the ranks (decode writes rotate), I = bs keeps a
physical block's tokens on one rank.

Attention: softmax over the union of shards = exact rescale of each shard's softmax. A rank
returns out_m (softmax over its keys) and lse_m = log sum exp(scores over its keys); then
    out = sum_m exp(lse_m - LSE) out_m,   LSE = logsumexp_m lse_m,
and a shard with no keys (lse -inf) weighs 0.

Prefill context parallel (PCP): a prefill chunk of n tokens is cut into 2 * pcp near-equal
chunks; rank r computes chunks r and 2 * pcp - 1 - r, so under a causal mask every rank has an
early (cheap) and a late (expensive) chunk and the same work:

    pcp = 2, n = 10:   chunks [0,3) [3,6) [6,8) [8,10)   rank 0: 0 1 2 8 9   rank 1: 3 4 5 6 7
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from shardserve.model import native_kernels

_DTYPES = {torch.float32: 0, torch.bfloat16: 1}  # the kernels' element types (cpu_kernels.c)


@dataclass(frozen=True)
class ContextShards:
    """One rank's view of a DCP group: the ownership math of the module docstring."""

    size: int  # dcp
    rank: int  # index in the DCP group
    interleave: int  # I
    block_size: int  # bs, the physical block of one rank

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} is not in a DCP group of size {self.size}")
        if self.interleave < 1 or self.block_size % self.interleave:
            raise ValueError(f"cp_kv_cache_interleave_size {self.interleave} must be >= 1 and "
                             f"divide block_size {self.block_size}")

    @property
    def virtual_block_size(self) -> int:
        """The block the scheduler and the prefix cache count in: bs slots on each rank."""
        return self.block_size * self.size

    def owner(self, positions: torch.Tensor) -> torch.Tensor:
        """The rank storing each position's K/V."""
        return (positions % self.virtual_block_size) // self.interleave % self.size

    def local_index(self, positions: torch.Tensor) -> torch.Tensor:
        """Each position's index among its owner's keys (meaningful where owner == rank)."""
        o = positions % self.virtual_block_size
        cycle = self.interleave * self.size
        return (positions // self.virtual_block_size) * self.block_size \
            + (o // cycle) * self.interleave + o % self.interleave

    def num_local(self, lengths: torch.Tensor) -> torch.Tensor:
        """How many of positions 0 .. n-1 this rank owns, for each n in `lengths`."""
        full, rest = lengths // self.virtual_block_size, lengths % self.virtual_block_size
        cycle = self.interleave * self.size
        in_cycle = (rest % cycle - self.rank * self.interleave).clamp(0, self.interleave)
        return full * self.block_size + (rest // cycle) * self.interleave + in_cycle


def balanced_chunks(n: int, pcp: int) -> list[tuple[int, int]]:
    """The 2 * pcp [start, end) chunks of n tokens, in order; sizes differ by at most one, the
    earlier chunks taking the remainder."""
    if n < 0 or pcp < 1:
        raise ValueError(f"cannot split {n} tokens over prefill_context_parallel_size {pcp}")
    parts = 2 * pcp
    base, extra = divmod(n, parts)
    ends = np.cumsum([base + (i < extra) for i in range(parts)])
    return [(int(e - (base + (i < extra))), int(e)) for i, e in enumerate(ends)]


def rank_token_indices(n: int, pcp: int, rank: int) -> np.ndarray:
    """The indices 0 .. n-1 that PCP rank `rank` computes: chunk rank, then chunk 2*pcp-1-rank."""
    if not 0 <= rank < pcp:
        raise ValueError(f"rank {rank} is not in a PCP group of size {pcp}")
    chunks = balanced_chunks(n, pcp)
    (a0, a1), (b0, b1) = chunks[rank], chunks[2 * pcp - 1 - rank]
    return np.concatenate([np.arange(a0, a1), np.arange(b0, b1)]).astype(np.int64)


def partial_attention(
    q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, row_req: torch.Tensor,
    num_visible: torch.Tensor, scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's attention over the local keys it may see, with its log-sum-exp.

    q [T, Hq, D] (float32 or bfloat16, unit-stride rows); kv_cache [NB, bs, 2, Hkv, D] (q's
    dtype); block_table [R, W] int64; row_req [T] int64 (row -> request row of block_table);
    num_visible [T] int64 (row t sees local keys j < num_visible[t]). Query head h reads KV head
    h // (Hq // Hkv). Returns out [T, Hq, D] and lse [T, Hq], float32; a row that sees nothing
    gets out 0, lse -inf (it weighs 0 in merge_partials). C where the kernels take the tensors
    (csrc/cp_attention.c), else PyTorch."""
    _check_rows(q, kv_cache, block_table, row_req, num_visible)
    if q.numel() == 0:
        t, h, d = q.shape
        return torch.zeros(t, h, d), torch.full((t, h), float("-inf"))
    if native_kernels.supports(q.dtype, q.device) and q.stride(-1) == 1 \
            and q.stride(1) == q.shape[2]:
        return _partial_attention_c(q, kv_cache, block_table, row_req, num_visible, scale)
    for code in (-2, -3, -4):  # the C kernel checks the ranges itself, without torch calls
        if (error := _range_error(code, kv_cache, block_table, row_req, num_visible)) is not None:
            raise error
    return partial_attention_torch(q, kv_cache, block_table, row_req, num_visible, scale)


def _range_error(code: int, kv_cache: torch.Tensor, block_table: torch.Tensor,
                 row_req: torch.Tensor, num_visible: torch.Tensor) -> ValueError | None:
    """The error for C's code (-2 row_req, -3 num_visible, -4 a block id) where the values are
    out of range, else None: torch indexing would wrap negative values round silently, and C
    reads where they point."""
    rows, width = block_table.shape
    capacity = width * kv_cache.shape[1]
    if code == -2 and (int(row_req.min()) < 0 or int(row_req.max()) >= rows):
        return ValueError(f"partial_attention: row_req outside the block table's {rows} rows")
    if code == -3 and (int(num_visible.min()) < 0 or int(num_visible.max()) > capacity):
        return ValueError(f"partial_attention: num_visible up to {int(num_visible.max())} "
                          f"keys, but a block table row holds {capacity}")
    if code == -4:
        reach = (num_visible + kv_cache.shape[1] - 1) // kv_cache.shape[1]  # blocks per row
        used = torch.arange(width, device=reach.device)[None, :] < reach[:, None]
        ids = block_table[row_req][used]
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= kv_cache.shape[0]):
            return ValueError(f"partial_attention: a block id the rows reach is outside the "
                              f"cache's {kv_cache.shape[0]} blocks")
    return None


def _check_rows(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                row_req: torch.Tensor, num_visible: torch.Tensor) -> None:
    """Shapes and dtypes (free to check); the values' ranges: _range_error."""
    if q.dim() != 3 or kv_cache.dim() != 5 or kv_cache.shape[2] != 2 \
            or kv_cache.shape[4] != q.shape[2] or q.shape[1] % kv_cache.shape[3] \
            or q.dtype != kv_cache.dtype:
        raise ValueError(f"partial_attention: q {tuple(q.shape)} {q.dtype} does not fit the "
                         f"cache {tuple(kv_cache.shape)} {kv_cache.dtype}")
    for name, t in (("block_table", block_table), ("row_req", row_req),
                    ("num_visible", num_visible)):
        if t.dtype != torch.int64:
            raise ValueError(f"partial_attention: {name} must be int64, got {t.dtype}")
    if row_req.shape != (q.shape[0],) or num_visible.shape != (q.shape[0],):
        raise ValueError(f"partial_attention: row_req {tuple(row_req.shape)} and num_visible "
                         f"{tuple(num_visible.shape)} must have one entry per query row "
                         f"({q.shape[0]})")


def _partial_attention_c(
    q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, row_req: torch.Tensor,
    num_visible: torch.Tensor, scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    t, num_heads, head_dim = q.shape
    _, block_size, _, num_kv, _ = kv_cache.shape
    kv_cache, block_table = kv_cache.contiguous(), block_table.contiguous()
    row_req, num_visible = row_req.contiguous(), num_visible.contiguous()
    out = torch.empty(t, num_heads, head_dim, dtype=torch.float32)
    lse = torch.empty(t, num_heads, dtype=torch.float32)
    rc = native_kernels.lib().cp_partial_attention(
        out.data_ptr(), lse.data_ptr(), q.data_ptr(), q.stride(0), kv_cache.data_ptr(),
        block_table.data_ptr(), block_table.stride(0), row_req.data_ptr(),
        num_visible.data_ptr(), t, num_heads, num_kv, head_dim, block_size, scale,
        _DTYPES[q.dtype], *block_table.shape, kv_cache.shape[0], torch.get_num_threads(),
    )
    if rc == -1:
        raise MemoryError("cp_partial_attention: out of memory for its scratch buffers")
    if rc != 0:
        raise _range_error(rc, kv_cache, block_table, row_req, num_visible) or \
            ValueError(f"partial_attention: rows out of range (code {rc})")
    return out, lse


def partial_attention_torch(
    q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, row_req: torch.Tensor,
    num_visible: torch.Tensor, scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """partial_attention in PyTorch (other dtypes and devices), in float32: per request, its
    longest row's keys gathered once and masked per row (GQA by a view, no copy of K/V)."""
    t, num_heads, head_dim = q.shape
    num_kv = kv_cache.shape[3]
    out = torch.zeros(t, num_heads, head_dim, device=q.device)
    lse = torch.full((t, num_heads), float("-inf"), device=q.device)
    for req in torch.unique(row_req).tolist():
        rows = torch.nonzero(row_req == req).squeeze(1)
        limit = num_visible[rows]
        width = int(limit.max())
        if width == 0:
            continue
        k, v = _request_keys(kv_cache, block_table[req], width)  # [Hkv, L, D] each
        qr = q[rows].float().view(-1, num_kv, num_heads // num_kv, head_dim) * scale
        scores = torch.einsum("rkgd,kld->rkgl", qr, k)
        visible = torch.arange(width, device=q.device)[None, :] < limit[:, None]  # [r, L]
        scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
        row_lse = torch.logsumexp(scores, dim=-1)  # [r, Hkv, G]; -inf where nothing visible
        probs = torch.exp(scores - row_lse[..., None]).nan_to_num(0.0)
        out[rows] = torch.einsum("rkgl,kld->rkgd", probs, v).reshape(-1, num_heads, head_dim)
        lse[rows] = row_lse.reshape(-1, num_heads)
    return out, lse


def _request_keys(kv_cache: torch.Tensor, blocks: torch.Tensor, width: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V [Hkv, width, D] float32 of a request's first `width` local keys."""
    bs, num_kv, head_dim = kv_cache.shape[1], kv_cache.shape[3], kv_cache.shape[4]
    j = torch.arange(width, device=kv_cache.device)
    slots = blocks[j // bs] * bs + j % bs
    ctx = kv_cache.reshape(-1, 2, num_kv, head_dim)[slots].float()  # [L, 2, Hkv, D]
    return ctx[:, 0].transpose(0, 1), ctx[:, 1].transpose(0, 1)


def merge_partials(outs: torch.Tensor, lses: torch.Tensor) -> torch.Tensor:
    """The exact merge of S shards' partials: outs [S, T, H, D] and lses [S, T, H] float32 ->
    [T, H, D] float32, sum_s exp(lse_s - LSE) out_s with LSE = logsumexp_s lse_s, summed in
    shard order (every rank merging the same partials gets the same bits); rows whose every
    lse is -inf get 0."""
    if outs.dtype != torch.float32 or lses.dtype != torch.float32 or outs.dim() != 4 \
            or outs.shape[:-1] != lses.shape:
        raise ValueError(f"merge_partials needs float32 outs [S, T, H, D] and lses [S, T, H], "
                         f"got {tuple(outs.shape)} {outs.dtype} and {tuple(lses.shape)} "
                         f"{lses.dtype}")
    if native_kernels.supports(outs.dtype, outs.device) and outs.numel():
        outs, lses = outs.contiguous(), lses.contiguous()
        out = torch.empty(outs.shape[1:], dtype=torch.float32)
        rc = native_kernels.lib().cp_merge(out.data_ptr(), outs.data_ptr(), lses.data_ptr(),
                                           outs.shape[0], lses[0].numel(), outs.shape[-1],
                                           torch.get_num_threads())
        if rc != 0:
            raise MemoryError("cp_merge failed")
        return out
    return merge_partials_torch(outs, lses)


def merge_partials_torch(outs: torch.Tensor, lses: torch.Tensor) -> torch.Tensor:
    """merge_partials in PyTorch (other devices, or without the C kernels)."""
    lse = torch.logsumexp(lses, dim=0)  # [T, H]; -inf where no shard saw a key
    weights = torch.exp(lses - lse).nan_to_num(0.0)  # -inf - -inf = nan -> 0
    return (weights.unsqueeze(-1) * outs).sum(0)
