"""Context parallelism's math and kernels (model/context_parallel.py, csrc/cp_attention.c).

The oracle is plain attention over the whole context in float64, written out here: each rank's
shard is built from the ownership math, attended by partial_attention, and the shards' partials
merged must give it back. Run under the AVX-512 build, the portable build and the PyTorch path.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shardserve.model import context_parallel as cp
from shardserve.model import native_kernels as nk
from shardserve.model.context_parallel import ContextShards

BS = 8  # physical block size of these tests
# (Hq, Hkv, D): the default model; 1 KV head; a head_dim tail; 24 heads on one KV head (more
# query vectors than a vector's 16 lanes in a decode row)
HEADS = [(9, 3, 64), (4, 1, 16), (6, 2, 20), (24, 1, 32)]
GROUPS = [(2, 1), (3, 2), (2, BS)]  # (dcp, interleave)


pytestmark = pytest.mark.usefixtures("native_kernels_on")  # tests/model/conftest.py


@pytest.fixture(params=["native", "portable", "pytorch"])
def path(request, monkeypatch):
    """Each way the attention runs: the build for this CPU, the one without AVX-512, PyTorch."""
    if request.param == "pytorch":
        monkeypatch.setenv("SHARDSERVE_NATIVE_KERNELS", "0")
        nk.library.cache_clear()
        yield request.param
        return
    if not nk.compiler_available():
        pytest.skip("no C compiler (SHARDSERVE_CC): PyTorch path only")
    assert nk.library() is not None, "the kernels failed to build"
    if request.param == "native":
        yield request.param
        return
    with nk.using(nk.build_library(nk.PORTABLE_ARCH)):
        yield request.param


@pytest.mark.parametrize("dcp", [1, 2, 3])
@pytest.mark.parametrize("interleave", [1, 2, BS])
def test_every_position_has_one_owner_and_dense_local_indices(dcp, interleave) -> None:
    n = 5 * BS * dcp + 3
    positions = torch.arange(n)
    counts = torch.zeros(n, dtype=torch.int64)
    for rank in range(dcp):
        shards = ContextShards(dcp, rank, interleave, BS)
        mine = positions[shards.owner(positions) == rank]
        counts[mine] += 1
        # Dense and in position order: the owner's keys 0..k-1, so causal limits are prefixes.
        assert torch.equal(shards.local_index(mine), torch.arange(mine.numel()))
        # num_local(n) = how many of 0..n-1 are mine, for every n.
        owned = torch.cumsum(shards.owner(positions) == rank, 0)
        lengths = torch.arange(n + 1)
        assert torch.equal(shards.num_local(lengths), torch.cat([torch.zeros(1), owned]).long())
        # Runs of `interleave` positions: a physical block of one rank fills before the next.
        assert torch.equal(shards.owner(positions[: interleave * dcp]),
                           torch.arange(dcp).repeat_interleave(interleave))
    assert bool((counts == 1).all())


def test_the_layout_of_the_module_docstring() -> None:
    """dcp 2, I 2, bs 4: the contract's formulas, position by position."""
    positions = torch.arange(16)
    rank1 = ContextShards(2, 1, 2, 4)
    assert rank1.virtual_block_size == 8
    assert rank1.owner(positions).tolist() == [0, 0, 1, 1, 0, 0, 1, 1] * 2
    assert rank1.local_index(positions).tolist() == [0, 1, 0, 1, 2, 3, 2, 3,
                                                     4, 5, 4, 5, 6, 7, 6, 7]
    assert rank1.num_local(torch.tensor([0, 2, 3, 9, 16])).tolist() == [0, 0, 1, 4, 8]
    assert cp.rank_token_indices(10, 2, 0).tolist() == [0, 1, 2, 8, 9]
    assert cp.rank_token_indices(10, 2, 1).tolist() == [3, 4, 5, 6, 7]


def test_bad_group_shapes_are_refused() -> None:
    with pytest.raises(ValueError, match="divide block_size 8"):
        ContextShards(2, 0, 3, BS)
    with pytest.raises(ValueError, match="rank 2 is not in a DCP group of size 2"):
        ContextShards(2, 2, 1, BS)


def shard_caches(kv, lengths, dcp, interleave, dtype):
    """Every rank's cache of the requests kv [R, L, 2, Hkv, D] (request r: its first lengths[r]
    positions) and the block table the ranks share (virtual block b = local block b on each).
    Slots a rank must not read hold large stale values."""
    r, _, _, hkv, d = kv.shape
    v = BS * dcp
    width = max(-(-int(n) // v) for n in lengths)
    num_blocks = r * width + 2
    table = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(1))
    table = table[: r * width].view(r, width)
    caches = []
    for rank in range(dcp):
        shards = ContextShards(dcp, rank, interleave, BS)
        cache = torch.full((num_blocks, BS, 2, hkv, d), 1e3)
        flat = cache.view(-1, 2, hkv, d)
        for req, n in enumerate(lengths):
            pos = torch.arange(int(n))
            pos = pos[shards.owner(pos) == rank]
            j = shards.local_index(pos)
            flat[table[req][j // BS] * BS + j % BS] = kv[req, pos]
        caches.append(cache.to(dtype))
    return caches, table


def reference(q, kv, row_req, row_pos):
    """Softmax attention of each row over positions 0..row_pos of its request, float64."""
    hq, hkv = q.shape[1], kv.shape[3]
    out = []
    for t in range(q.shape[0]):
        ctx = kv[row_req[t], : row_pos[t] + 1].double()
        k = ctx[:, 0].repeat_interleave(hq // hkv, 1).transpose(0, 1)  # [H, L, D]
        v = ctx[:, 1].repeat_interleave(hq // hkv, 1).transpose(0, 1)
        att = torch.softmax(q[t].double().unsqueeze(1) @ k.transpose(1, 2) / q.shape[2] ** .5, -1)
        out.append((att @ v).squeeze(1))
    return torch.stack(out)


def sharded_attention(q, caches, table, row_req, row_pos, interleave):
    """partial_attention on every rank, then merge_partials; also returns the partials."""
    outs, lses = [], []
    for rank, cache in enumerate(caches):
        shards = ContextShards(len(caches), rank, interleave, BS)
        visible = shards.num_local(row_pos + 1)
        out, lse = cp.partial_attention(q, cache, table, row_req, visible, q.shape[2] ** -0.5)
        outs.append(out)
        lses.append(lse)
    return cp.merge_partials(torch.stack(outs), torch.stack(lses)), lses


def batch(hq, hkv, d, lengths, chunk):
    """Random K/V for the requests and a step's rows: a decode row for every request but the
    last, whose last `chunk` positions are a prefill chunk (consecutive rows, as the runner
    lays them out, after the first decode row: tiles of one request that start mid-batch)."""
    gen = torch.Generator().manual_seed(hq * 7 + d)
    kv = torch.randn(len(lengths), max(lengths), 2, hkv, d, generator=gen)
    last = len(lengths) - 1
    row_req = [last - 1] + [last] * chunk + list(range(last - 1))
    row_pos = [lengths[last - 1] - 1] + [lengths[last] - chunk + i for i in range(chunk)] \
        + [n - 1 for n in lengths[: last - 1]]
    q = torch.randn(len(row_req), hq, d, generator=gen)
    return kv, q, torch.tensor(row_req), torch.tensor(row_pos)


@pytest.mark.parametrize(("hq", "hkv", "d"), HEADS)
@pytest.mark.parametrize(("dcp", "interleave"), GROUPS)
def test_merged_shards_equal_full_attention(path, hq, hkv, d, dcp, interleave) -> None:
    # Contexts: 1 token (the other ranks' shards empty), one block's worth, odd lengths, and a
    # 70-token request whose last 37 positions are a prefill chunk (more than a row tile).
    lengths = [1, BS - 1, 2 * BS * dcp + 3, 70]
    kv, q, row_req, row_pos = batch(hq, hkv, d, lengths, chunk=37)  # tiles of 16, 16 and 5
    caches, table = shard_caches(kv, lengths, dcp, interleave, torch.float32)
    merged, lses = sharded_attention(q, caches, table, row_req, row_pos, interleave)
    torch.testing.assert_close(merged.double(), reference(q, kv, row_req, row_pos),
                               atol=1e-5, rtol=1e-5)
    # The 1-token request's row saw nothing on ranks > 0: lse -inf there, weight 0.
    one = int(torch.nonzero(row_req == 0)[0])
    assert all(bool(torch.isneginf(lse[one]).all()) for lse in lses[1:])


@pytest.mark.parametrize(("hq", "hkv", "d"), HEADS[:2])
def test_bfloat16_shards_merge_within_bfloat16_error(path, hq, hkv, d) -> None:
    lengths = [5, 40, 90]
    kv, q, row_req, row_pos = batch(hq, hkv, d, lengths, chunk=20)
    kv, q = kv.bfloat16(), q.bfloat16()
    caches, table = shard_caches(kv.float(), lengths, 2, 2, torch.bfloat16)
    merged, _ = sharded_attention(q, caches, table, row_req, row_pos, 2)
    assert merged.dtype == torch.float32
    torch.testing.assert_close(merged.double(), reference(q, kv, row_req, row_pos),
                               atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("kernels", ["native", "portable"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_c_kernel_equals_the_pytorch_path(kernels, dtype) -> None:
    if not nk.compiler_available():
        pytest.skip("no C compiler (SHARDSERVE_CC)")
    kv, q, row_req, row_pos = batch(9, 3, 64, [3, 33, 130], chunk=50)
    caches, table = shard_caches(kv, [3, 33, 130], 3, 1, dtype)
    visible = ContextShards(3, 1, 1, BS).num_local(row_pos + 1)
    # Query rows strided, as views into a fused qkv output are.
    q = torch.cat([q, torch.randn(q.shape[0], 5, 64)], 1).to(dtype)[:, :9]
    lib = nk.library() if kernels == "native" else nk.build_library(nk.PORTABLE_ARCH)
    with nk.using(lib):
        c_out, c_lse = cp.partial_attention(q, caches[1], table, row_req, visible, .125)
        torch_out, torch_lse = cp.partial_attention_torch(q, caches[1], table, row_req, visible,
                                                          .125)
        stacked = torch.stack([c_out, torch_out]), torch.stack([c_lse, torch_lse])
        c_merged = cp.merge_partials(*stacked)
    torch.testing.assert_close(c_out, torch_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(c_lse, torch_lse, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(c_merged, cp.merge_partials_torch(*stacked), atol=1e-6, rtol=1e-6)


def test_merge_weighs_shards_by_their_lse(path) -> None:
    outs = torch.randn(3, 4, 2, 8)
    lses = torch.tensor([0.0, 1.0, float("-inf")]).view(3, 1, 1).expand(3, 4, 2).clone()
    lses[:, 3, 1] = float("-inf")  # a row no shard saw a key for
    merged = cp.merge_partials(outs, lses)
    w0, w1 = 1 / (1 + np.e), np.e / (1 + np.e)
    expected = w0 * outs[0] + w1 * outs[1]
    expected[3, 1] = 0
    torch.testing.assert_close(merged, expected)


def test_out_of_range_rows_are_refused(path) -> None:
    kv, q, row_req, row_pos = batch(4, 1, 16, [9, 20], chunk=4)
    caches, table = shard_caches(kv, [9, 20], 1, 1, torch.float32)
    capacity = table.shape[1] * BS
    with pytest.raises(ValueError, match=f"a block table row holds {capacity}"):
        cp.partial_attention(q, caches[0], table, row_req, row_pos + capacity, 1.0)
    with pytest.raises(ValueError, match="row_req outside the block table's 2 rows"):
        cp.partial_attention(q, caches[0], table, row_req + 2, row_pos + 1, 1.0)
    with pytest.raises(ValueError, match="row_req outside"):
        cp.partial_attention(q, caches[0], table, row_req - 2, row_pos + 1, 1.0)
    with pytest.raises(ValueError, match="one entry per query row"):
        cp.partial_attention(q, caches[0], table, row_req[:1], row_pos + 1, 1.0)
    bad = table.clone()
    bad[1, 1] = caches[0].shape[0]  # a block the 20-token request reaches
    with pytest.raises(ValueError, match="outside the cache's 8 blocks"):
        cp.partial_attention(q, caches[0], bad, row_req, row_pos + 1, 1.0)
    bad[1, 1], bad[0, 2] = table[1, 1], -1  # the 9-token request's 3rd block: padding, unread
    out, _ = cp.partial_attention(q, caches[0], bad, row_req, row_pos + 1, 1.0)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("pcp", [1, 2, 3])
@pytest.mark.parametrize("n", [0, 1, 5, 12, 13, 257])
def test_balanced_split_and_its_inverse(pcp, n) -> None:
    chunks = cp.balanced_chunks(n, pcp)
    assert len(chunks) == 2 * pcp and chunks[0][0] == 0 and chunks[-1][1] == n
    assert all(a[1] == b[0] for a, b in zip(chunks, chunks[1:], strict=False))
    sizes = [e - s for s, e in chunks]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)
    parts = [cp.rank_token_indices(n, pcp, r) for r in range(pcp)]
    for r, part in enumerate(parts):  # chunk r, then its mirror 2*pcp-1-r
        early, late = chunks[r], chunks[2 * pcp - 1 - r]
        assert part.tolist() == [*range(*early), *range(*late)]
    # Together a permutation of 0..n-1; its argsort puts the ranks' rows back in order.
    order = np.concatenate(parts)
    assert sorted(order.tolist()) == list(range(n))
    tokens = np.arange(n) * 10
    assert np.array_equal(np.concatenate([tokens[p] for p in parts])[np.argsort(order)], tokens)
    # Causal balance: the ranks' attention work (sum of positions + 1, ~n^2 / 2pcp each) differs
    # by O(n) only, where contiguous chunks would differ by ~n^2 / pcp.
    work = [int((p + 1).sum()) for p in parts]
    assert max(work) - min(work) <= 2 * n + 2
