"""KVCacheManager: the block pool's bookkeeping (pure Python, no torch)."""

from __future__ import annotations

import random

import pytest

from shardserve.engine.kv_cache import KVCacheManager


def owned(kv: KVCacheManager) -> list[int]:
    return [b for rid in list(kv._tables) for b in kv.block_ids(rid)]


def assert_partition(kv: KVCacheManager) -> None:
    """Every block is free or owned by exactly one request."""
    used, free = owned(kv), list(kv._free)
    assert len(used) == len(set(used)), "a block is owned twice"
    assert len(free) == len(set(free)), "a block is free twice"
    assert not set(used) & set(free), "a block is both free and owned"
    assert sorted(used + free) == list(range(kv.num_blocks))


@pytest.mark.parametrize(("tokens", "blocks"), [(0, 0), (1, 1), (4, 1), (5, 2), (16, 4)])
def test_blocks_needed(tokens, blocks):
    assert KVCacheManager(8, 4).blocks_needed(tokens) == blocks


def test_allocate_grows_the_table_and_returns_only_new_blocks():
    kv = KVCacheManager(8, 4)
    first = kv.allocate("a", 6)
    assert len(first) == 2 and kv.block_ids("a") == first
    assert kv.allocate("a", 8) == []  # still fits in two blocks
    third = kv.allocate("a", 9)
    assert len(third) == 1 and kv.block_ids("a") == first + third
    assert kv.num_free_blocks == 5
    assert_partition(kv)


def test_allocate_returns_none_without_partial_allocation():
    kv = KVCacheManager(4, 4)
    kv.allocate("a", 8)
    before = list(kv.block_ids("b"))
    assert kv.allocate("b", 12) is None  # needs 3, 2 free
    assert kv.num_free_blocks == 2 and kv.block_ids("b") == before
    assert kv.allocate("a", 20) is None  # needs 3 more, 2 free
    assert len(kv.block_ids("a")) == 2 and kv.num_free_blocks == 2
    assert kv.allocate("b", 8) is not None  # exactly what is left
    assert kv.num_free_blocks == 0
    assert_partition(kv)


def test_free_returns_blocks_and_usage_follows():
    kv = KVCacheManager(10, 2)
    assert kv.usage == 0.0
    kv.allocate("a", 6)
    kv.allocate("b", 4)
    assert kv.usage == pytest.approx(0.5)
    a_blocks = list(kv.block_ids("a"))
    kv.free("a")
    assert kv.block_ids("a") == [] and kv.num_free_blocks == 8
    assert kv.usage == pytest.approx(0.2)
    assert kv.allocate("c", 6) == a_blocks  # freed blocks are reused first
    kv.free("b")
    kv.free("c")
    kv.free("never-allocated")  # no-op
    assert kv.usage == 0.0 and kv.num_free_blocks == 10
    assert_partition(kv)


def test_random_allocate_free_keeps_the_partition():
    rng = random.Random(0)
    kv = KVCacheManager(32, 4)
    sizes: dict[str, int] = {}
    for _ in range(2000):
        rid = f"r{rng.randrange(8)}"
        if rng.random() < 0.25:
            kv.free(rid)
            sizes.pop(rid, None)
            continue
        target = sizes.get(rid, 0) + rng.randrange(1, 12)
        free_before = kv.num_free_blocks
        new = kv.allocate(rid, target)
        if new is None:
            assert kv.num_free_blocks == free_before
        else:
            sizes[rid] = target
            assert len(kv.block_ids(rid)) == kv.blocks_needed(target)
        assert_partition(kv)
