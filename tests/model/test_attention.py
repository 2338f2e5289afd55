"""Paged attention pieces in isolation: the cache allocation and whole-block gathers."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shardserve.model.attention import AttentionMetadata, allocate_kv_cache, paged_attention


def test_kv_cache_starts_zeroed() -> None:
    # Whole-block gathers read slots nobody wrote yet; they must be finite (see attention.py).
    caches = allocate_kv_cache(2, 5, 4, 2, 8, torch.float32)
    assert len(caches) == 2 and all(c.shape == (5, 4, 2, 2, 8) for c in caches)
    assert all(bool((c == 0).all()) for c in caches)


def test_kv_cache_layers_are_separate_writable_memory() -> None:
    # Each layer is its own zero-filled-on-touch mapping (attention._lazily_zeroed), in bf16 too.
    caches = allocate_kv_cache(3, 64, 16, 2, 64, torch.bfloat16)
    assert all(c.dtype == torch.bfloat16 and c.is_contiguous() for c in caches)
    assert all(c.data_ptr() % 64 == 0 for c in caches)
    caches[1][5, 3] = 7.0
    assert bool((caches[1][5, 3] == 7).all()) and int((caches[1] != 0).sum()) == 2 * 2 * 64
    assert bool((caches[0] == 0).all()) and bool((caches[2] == 0).all())
    del caches[1]  # unmapped with its last view; the others stay valid
    assert float(caches[0].float().sum()) == 0.0


def test_decodes_of_ragged_lengths_match_dense_attention(kernel_path: str) -> None:
    """Three decodes with contexts 5, 9 and 2 over shuffled blocks of 4, stale values in the
    unwritten tails: each equals plain SDPA over its own keys."""
    g = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, bs = 4, 2, 8, 4
    cache = allocate_kv_cache(1, 12, bs, kv_heads, dim, torch.float32)[0]
    cache.uniform_(-50, 50, generator=g)  # stale K/V of freed blocks
    lens, tables = [5, 9, 2], [[7, 2], [0, 11, 5], [9]]
    context = []
    for n, table in zip(lens, tables, strict=True):
        kv = torch.randn(n - 1, 2, kv_heads, dim, generator=g)
        for pos in range(n - 1):
            cache[table[pos // bs], pos % bs] = kv[pos]
        context.append(kv)
    q = torch.randn(3, heads, dim, generator=g)
    new_kv = torch.randn(3, 2, kv_heads, dim, generator=g)
    meta = AttentionMetadata.build([1, 1, 1], lens, tables, bs)
    out = paged_attention(q, new_kv, cache, meta)
    for i in range(len(lens)):
        kv = torch.cat([context[i], new_kv[i : i + 1]])  # [n, 2, Hkv, D]
        k = kv[:, 0].transpose(0, 1).repeat_interleave(heads // kv_heads, 0)
        v = kv[:, 1].transpose(0, 1).repeat_interleave(heads // kv_heads, 0)
        want = F.scaled_dot_product_attention(q[i].unsqueeze(1), k, v)  # [H, 1, D]
        torch.testing.assert_close(out[i].view(heads, dim), want[:, 0], rtol=1e-5, atol=1e-5)


def test_prefill_per_row_equals_one_padded_group() -> None:
    """A decode, a fresh prefill, two later chunks with far-apart ends and another decode:
    each prefill row a group of its own (as a context-parallel rank runs its two chunks of a
    prompt) gives the rows of one padded group, in flat order."""
    g = torch.Generator().manual_seed(1)
    heads, kv_heads, dim, bs = 4, 2, 8, 4
    cache = allocate_kv_cache(1, 24, bs, kv_heads, dim, torch.float32)[0]
    cache.uniform_(-1, 1, generator=g)  # every earlier position's K/V
    query_lens, seq_lens = [1, 6, 3, 5, 1], [7, 6, 20, 40, 3]
    tables = [[0, 1], [2, 3], [4, 5, 6, 7, 8], list(range(9, 19)), [19]]
    n = sum(query_lens)
    q = torch.randn(n, heads, dim, generator=g)
    kv = torch.randn(n, 2, kv_heads, dim, generator=g)
    outs = []
    for per_row in (False, True):
        meta = AttentionMetadata.build(query_lens, seq_lens, tables, bs, prefill_per_row=per_row)
        assert len(meta.prefill_groups) == (3 if per_row else 1)
        outs.append(paged_attention(q, kv, cache.clone(), meta))
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)


def test_decode_only_metadata_equals_the_general_build() -> None:
    """A step of decodes takes the numpy shortcut (AttentionMetadata._decodes): every field
    equals what the general build (_mixed) makes of the same step, ragged tables and a mask
    included, and full blocks with no mask."""
    cases = [([5, 9, 2, 16], [[7, 2], [0, 11, 5], [9], [3, 4, 6, 8]], 4),
             ([8, 8], [[1, 2], [3, 4]], 4), ([1], [[0]], 16), ([33, 17], [[2, 0, 5], [1, 4]], 16)]
    for seq_lens, tables, bs in cases:
        fast = AttentionMetadata.build([1] * len(seq_lens), seq_lens, tables, bs)
        general = AttentionMetadata._mixed([1] * len(seq_lens), seq_lens, tables, bs, "cpu",
                                           False)
        for name in ("num_tokens", "max_seq_len", "output_index", "prefill_groups"):
            assert getattr(fast, name) == getattr(general, name), name
        for name in ("positions", "logits_indices", "slot_mapping"):
            assert torch.equal(getattr(fast, name), getattr(general, name)), name
        a, b = fast.decode, general.decode
        assert a is not None and b is not None
        for name in ("query_index", "num_reqs", "max_query", "max_context", "causal_fresh"):
            assert getattr(a, name) == getattr(b, name), name
        for name in ("blocks", "seq_lens"):
            assert torch.equal(getattr(a, name), getattr(b, name)), name
        assert (a.mask is None) == (b.mask is None), seq_lens
        if a.mask is not None:
            assert a.mask.shape == b.mask.shape and torch.equal(a.mask, b.mask)
    assert AttentionMetadata.build([1, 1], [8, 8], [[1, 2], [3, 4]], 4).decode.mask is None
