"""Paged attention on CPU with vectorised PyTorch (the rotary embedding it is fed with: rotary.py).

KV cache layout (one tensor per layer): [num_blocks, block_size, 2, num_kv_heads, head_dim].
Keeping K and V of a slot adjacent lets one `index_copy_` write both for the whole flat batch and
one `index_select` gather both for every request's context. Slot s = block_id * block_size +
offset addresses row s of the [num_blocks * block_size, 2, Hkv, D] view.

A step's requests are split into two groups, each padded only to its own maximum:
  * decode rows (query_len == 1): one query per request, context padded to the longest decode;
  * prefill rows (query_len > 1, including later chunks of a chunked prefill): queries padded to
    the longest prefill chunk, context to the longest prefill context, with a causal mask
    (or, with `prefill_per_row`, each prefill row a group of its own, padded to nothing: a
    context-parallel rank's two chunks of one prompt end far apart).
So one long prefill next to many decodes costs (long x long) + (decodes x their contexts), not
(everyone x long). `AttentionMetadata.build` precomputes all indices and masks once per step;
the per-layer work is a fixed handful of tensor ops with no Python loop over requests.

Grouped-query attention without copying KV: the G = H / Hkv query heads sharing a KV head are
folded into the query-length dim, giving q [B, Hkv, G*Q, D] against k/v [B, Hkv, L, D].

Contexts are gathered by whole blocks (one `index_select` row = block_size slots), which moves
the same bytes 1.3-2x faster than gathering slot by slot; a group's context is padded to whole
blocks and the tail is masked.

Padding invariants: the cache is zero-initialised, so every gathered value is finite (a masked key
still meets its query in q.k, and 0 * NaN = NaN even under a mask); padded block-table entries
point at block 0, which is real memory; every padded query row can see at least key 0, so no
softmax row is fully masked.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from shardserve.model import native_kernels
from shardserve.model.huge_pages import huge_page_memory

KV_DIM = 2  # index of the K/V axis in a layer's cache tensor


@dataclass
class _Group:
    """One padded attention group (decodes or prefills) of B requests."""

    query_index: torch.Tensor | None  # int64 [B*Q] rows of the flat batch (None: all, in order)
    blocks: torch.Tensor  # int64 [B*W] cache blocks of each request's context (padded with 0)
    seq_lens: torch.Tensor  # int64 [B] context length of each request (this step's tokens included)
    mask: torch.Tensor | None  # bool [B, 1, Q, L=W*block_size] (True = attend); None: no mask
    num_reqs: int
    max_query: int
    max_context: int
    causal_fresh: bool = False  # one request, no cached prefix: plain causal over its own K/V
    # Additive mask with each query row repeated G times, built by the first layer and reused.
    _gqa_mask: torch.Tensor | None = None


@dataclass
class AttentionMetadata:
    num_tokens: int
    positions: torch.Tensor  # int64 [num_tokens]
    logits_indices: torch.Tensor  # int64 [B]
    slot_mapping: torch.Tensor  # int64 [num_tokens], where each new token's K/V is written
    max_seq_len: int  # host-side bound on positions (sizes the RoPE table without a sync)
    decode: _Group | None
    prefill_groups: list[_Group]
    # Flat-batch row -> row of cat(decode_out [Bd], each prefill group's out [Bp*Qp]); None when
    # identity.
    output_index: torch.Tensor | None
    # Context parallelism: the step's object with an `attention(q, kv, kv_cache, meta)` that
    # replaces paged_attention's (model/context_parallel_step.py); None without it.
    context: object | None = None

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str = "cpu",
        prefill_per_row: bool = False,
    ) -> AttentionMetadata:
        _validate(query_lens, seq_lens, block_tables, block_size)
        if max(query_lens) == 1:
            return cls._decodes(seq_lens, block_tables, block_size, torch.device(device))
        return cls._mixed(query_lens, seq_lens, block_tables, block_size, device,
                          prefill_per_row)

    @classmethod
    def _decodes(cls, seq_lens: list[int], block_tables: list[list[int]], block_size: int,
                 to: torch.device) -> AttentionMetadata:
        """A step of decodes only (the steady state of generation): the same metadata as
        `_mixed` builds, from a few numpy operations. `_mixed`'s dozen small torch operations
        cost ~0.3 ms a step, 5% of the default model's batch-1 step."""
        s = np.asarray(seq_lens, dtype=np.int64)
        width = max(len(b) for b in block_tables)
        bt = np.zeros((len(s), width), dtype=np.int64)
        for row, blocks in zip(bt, block_tables, strict=True):
            row[:len(blocks)] = blocks
        positions = s - 1
        rows = np.arange(len(s))
        slots = bt[rows, positions // block_size] * block_size + positions % block_size
        used = -(-int(s.max()) // block_size)  # blocks of the longest context
        valid = np.arange(used * block_size)[None, :] < s[:, None]
        decode = _Group(
            query_index=None, blocks=torch.from_numpy(bt[:, :used].reshape(-1)),
            seq_lens=torch.from_numpy(s),
            mask=None if valid.all() else torch.from_numpy(valid[:, None, None, :]),
            num_reqs=len(s), max_query=1, max_context=used * block_size)
        return cls(num_tokens=len(s), positions=torch.from_numpy(positions).to(to),
                   logits_indices=torch.from_numpy(rows).to(to),
                   slot_mapping=torch.from_numpy(slots).to(to), max_seq_len=int(s.max()),
                   decode=_group_to(decode, to), prefill_groups=[], output_index=None)

    @classmethod
    def _mixed(cls, query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]],
               block_size: int, device: torch.device | str,
               prefill_per_row: bool) -> AttentionMetadata:
        q = torch.tensor(query_lens, dtype=torch.int64)
        s = torch.tensor(seq_lens, dtype=torch.int64)
        bt = pad_block_tables(block_tables)
        starts = torch.cumsum(q, 0) - q  # first flat row of each request
        req_of_token = torch.repeat_interleave(torch.arange(len(q)), q)
        positions = torch.arange(int(q.sum())) - starts[req_of_token] + (s - q)[req_of_token]
        slot_mapping = _slots(bt[req_of_token], positions, block_size)

        dec = [i for i, n in enumerate(query_lens) if n == 1]
        pre = [i for i, n in enumerate(query_lens) if n > 1]
        decode = _build_group(dec, q, s, bt, starts, block_size) if dec else None
        split = [[i] for i in pre] if prefill_per_row else [pre] if pre else []
        prefill = [_build_group(g, q, s, bt, starts, block_size) for g in split]
        output_index = _output_index(q, dec, split, prefill)
        to = torch.device(device)
        return cls(
            num_tokens=int(q.sum()),
            positions=positions.to(to),
            logits_indices=(starts + q - 1).to(to),
            slot_mapping=slot_mapping.to(to),
            max_seq_len=max(seq_lens),
            decode=_group_to(decode, to),
            prefill_groups=[_group_to(g, to) for g in prefill],
            output_index=None if output_index is None else output_index.to(to),
        )

    @property
    def prefill(self) -> _Group | None:
        """The first prefill group (None: a step of decodes only)."""
        return self.prefill_groups[0] if self.prefill_groups else None


def _validate(
    query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]], block_size: int
) -> None:
    if not (len(query_lens) == len(seq_lens) == len(block_tables)) or not query_lens:
        raise ValueError("query_lens, seq_lens and block_tables must be non-empty and equal length")
    for i, (ql, sl, bt) in enumerate(zip(query_lens, seq_lens, block_tables, strict=True)):
        if ql < 1 or sl < ql:
            raise ValueError(f"request {i}: need 1 <= query_len ({ql}) <= seq_len ({sl})")
        if len(bt) * block_size < sl:
            raise ValueError(f"request {i}: {len(bt)} blocks cannot hold {sl} tokens")


def pad_block_tables(block_tables: list[list[int]]) -> torch.Tensor:
    """[R, W] int64, each table padded with block 0 (real memory) to the longest."""
    width = max(len(b) for b in block_tables)
    return torch.tensor([b + [0] * (width - len(b)) for b in block_tables], dtype=torch.int64)


def _slots(block_rows: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Cache slots of `positions` [N] given each position's block table row [N, W]."""
    blocks = torch.gather(block_rows, 1, (positions // block_size).unsqueeze(-1)).squeeze(-1)
    return blocks * block_size + positions % block_size


def _build_group(
    reqs: list[int],
    q: torch.Tensor,
    s: torch.Tensor,
    bt: torch.Tensor,
    starts: torch.Tensor,
    block_size: int,
) -> _Group:
    idx = torch.tensor(reqs, dtype=torch.int64)
    ql, sl, st = q[idx], s[idx], starts[idx]
    max_q = int(ql.max())
    width = -(-int(sl.max()) // block_size)  # blocks of the longest context
    max_l = width * block_size
    kpos = torch.arange(max_l).expand(len(reqs), max_l)
    key_valid = kpos < sl[:, None]
    # Query j of request r sits at flat row st+j and position (sl-ql)+j; padded query rows
    # repeat the request's last real query (their output is discarded).
    qj = torch.minimum(torch.arange(max_q).expand(len(reqs), max_q), (ql - 1)[:, None])
    query_index = (st[:, None] + qj).reshape(-1)
    qpos = (sl - ql)[:, None] + qj
    mask = key_valid[:, None, :] & (kpos[:, None, :] <= qpos[:, :, None])  # [B, Q, L]
    if bool(mask.all()):
        mask_out = None
    else:
        mask_out = mask.unsqueeze(1)
    identity = len(reqs) * max_q == int(q.sum()) and bool(
        (query_index == torch.arange(query_index.numel())).all()
    )
    return _Group(
        query_index=None if identity else query_index,
        blocks=bt[idx, :width].reshape(-1),
        seq_lens=sl,
        mask=mask_out,
        num_reqs=len(reqs),
        max_query=max_q,
        max_context=max_l,
        causal_fresh=len(reqs) == 1 and max_q > 1 and int(sl[0]) == int(ql[0]),
    )


def _output_index(q: torch.Tensor, dec: list[int], split: list[list[int]],
                  prefill: list[_Group]) -> torch.Tensor | None:
    """Map each flat row to its row in cat(decode outputs, each prefill group's padded ones)."""
    if not prefill or (not dec and len(prefill) == 1 and prefill[0].query_index is None):
        return None  # a single group whose rows are already in flat order
    first_row = torch.zeros(len(q), dtype=torch.int64)  # each request's first output row
    first_row[dec] = torch.arange(len(dec))
    start = len(dec)
    for reqs, g in zip(split, prefill, strict=True):
        first_row[reqs] = start + torch.arange(len(reqs)) * g.max_query
        start += g.num_reqs * g.max_query
    req_of_token = torch.repeat_interleave(torch.arange(len(q)), q)
    offset_in_req = torch.arange(int(q.sum())) - (torch.cumsum(q, 0) - q)[req_of_token]
    return first_row[req_of_token] + offset_in_req


def _group_to(group: _Group | None, device: torch.device) -> _Group | None:
    if group is None or device.type == "cpu":
        return group
    for name in ("query_index", "blocks", "seq_lens", "mask"):
        t = getattr(group, name)
        if t is not None:
            setattr(group, name, t.to(device))
    return group


def kv_cache_bytes_per_block(
    num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    itemsize = torch.empty((), dtype=dtype).element_size()
    return num_layers * block_size * 2 * num_kv_heads * head_dim * itemsize


def allocate_kv_cache(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
) -> list[torch.Tensor]:
    """One [num_blocks, block_size, 2, num_kv_heads, head_dim] tensor per layer, zeroed.

    Zeroed, not empty: whole-block gathers read slots no request has written yet (masked, but
    they must be finite, see the module docstring).
    """
    shape = (num_blocks, block_size, 2, num_kv_heads, head_dim)
    if torch.device(device).type != "cpu":
        return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
    return [_lazily_zeroed(shape, dtype) for _ in range(num_layers)]


def _lazily_zeroed(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor whose pages the kernel zero-fills on first touch.

    torch.zeros writes every byte up front: with the default 10% of RAM that was 1.3 s of a
    2-core machine's cold start, for blocks a short run never uses. Anonymous memory is zero by
    definition and costs nothing until touched (an untouched page read maps the shared zero
    page). In huge pages where Linux gives them (model/huge_pages.py: at long contexts decode
    streams much of the cache); unmapped when the last view of it is freed.
    """
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = math.prod(shape) * itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    return huge_page_memory(nbytes).view(dtype).view(shape)


def paged_attention(
    q: torch.Tensor, kv: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
) -> torch.Tensor:
    """Write this step's K/V into the cache, then attend. Returns [num_tokens, H * D].

    q: [T, H, D] (RoPE applied); kv: [T, 2, Hkv, D] (K with RoPE applied, V).
    """
    if meta.context is not None:
        return meta.context.attention(q, kv, kv_cache, meta)  # type: ignore[attr-defined]
    write_kv(kv_cache, kv, meta.slot_mapping)
    return attend(q, kv, kv_cache, meta)


def write_kv(kv_cache: torch.Tensor, kv: torch.Tensor, slots: torch.Tensor) -> None:
    """Row i of kv [N, 2, Hkv, D] into cache slot slots[i] (rounded to the cache's dtype where
    it is narrower: kv_cache_dtype="bfloat16" under float32)."""
    if native_kernels.supports(kv.dtype, kv.device) and kv[0].is_contiguous():
        native_kernels.cache_write(kv_cache, kv, slots)
    else:
        flat_cache = kv_cache.view(-1, *kv_cache.shape[2:])  # [slots, 2, Hkv, D]
        flat_cache.index_copy_(0, slots, kv.to(flat_cache.dtype))


def attend(
    q: torch.Tensor, kv: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
) -> torch.Tensor:
    """Attention of the step's rows over the cache (this step's K/V already written)."""
    outs = []
    if meta.decode is not None:
        outs.append(_attend_decode(q, kv, kv_cache, meta.decode))
    for group in meta.prefill_groups:
        outs.append(_attend_group(q, kv, kv_cache, group))
    out = outs[0] if len(outs) == 1 else torch.cat(outs, 0)
    if meta.output_index is not None:
        out = out.index_select(0, meta.output_index)
    return out


def _attend_decode(
    q: torch.Tensor, kv: torch.Tensor, kv_cache: torch.Tensor, g: _Group
) -> torch.Tensor:
    """Decode rows: the C kernel reads the cache in place where it can, else `_attend_group`."""
    if native_kernels.supports(q.dtype, q.device) and q.stride(-1) == 1:
        block_table = g.blocks.view(g.num_reqs, -1)
        return native_kernels.decode_attention(q, kv_cache, block_table, g.seq_lens, g.query_index)
    return _attend_group(q, kv, kv_cache, g)


def _attend_group(
    q: torch.Tensor, kv: torch.Tensor, kv_cache: torch.Tensor, g: _Group
) -> torch.Tensor:
    """Attention for one group; returns [B * Q, H * D] (padded query rows included)."""
    _, num_heads, head_dim = q.shape
    num_kv = kv_cache.shape[3]
    group = num_heads // num_kv
    if g.query_index is not None:
        q = q.index_select(0, g.query_index)
        if g.causal_fresh:
            kv = kv.index_select(0, g.query_index)
    if g.causal_fresh:
        return _attend_causal_fresh(q, kv)
    b, nq = g.num_reqs, g.max_query
    # [B*Q, H, D] -> [B, Hkv, Q*G, D]: the G heads sharing a KV head become extra query rows.
    qg = q.view(b, nq, num_kv, group, head_dim).transpose(1, 2).reshape(b, num_kv, nq * group, -1)
    ctx = kv_cache.index_select(0, g.blocks).view(b, g.max_context, 2, num_kv, head_dim)
    ctx = ctx.to(q.dtype)  # a bfloat16 cache under float32 q: its values, widened (else a no-op)
    k = ctx[:, :, 0].transpose(1, 2)
    v = ctx[:, :, 1].transpose(1, 2)
    out = F.scaled_dot_product_attention(qg, k, v, attn_mask=_gqa_mask(g, group, qg.dtype))
    # [B, Hkv, Q*G, D] -> [B*Q, H*D] with head index kv*G + g.
    out = out.view(b, num_kv, nq, group, head_dim).transpose(1, 2)
    return out.reshape(b * nq, num_heads * head_dim)


def _gqa_mask(g: _Group, group: int, dtype: torch.dtype) -> torch.Tensor | None:
    """The group's mask as an additive float mask (0 / -inf), each query row repeated G times.

    Built by the first layer and reused by the others: SDPA would otherwise convert a bool mask
    to a float one in every layer.
    """
    if g.mask is None:
        return None
    if g._gqa_mask is None or g._gqa_mask.dtype != dtype:
        mask = g.mask if group == 1 else g.mask.repeat_interleave(group, dim=2)  # rows (q, g)
        additive = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
        g._gqa_mask = additive.masked_fill_(~mask, float("-inf"))
    return g._gqa_mask


def _attend_causal_fresh(q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    """A single fresh prefill: its context is exactly this step's K/V, so skip the gather."""
    t, num_heads, head_dim = q.shape
    k = kv[:, 0].transpose(0, 1).unsqueeze(0)
    v = kv[:, 1].transpose(0, 1).unsqueeze(0)
    qh = q.transpose(0, 1).unsqueeze(0)
    out = F.scaled_dot_product_attention(qh, k, v, is_causal=True, enable_gqa=True)
    return out[0].transpose(0, 1).reshape(t, num_heads * head_dim)

