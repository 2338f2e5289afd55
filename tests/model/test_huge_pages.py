"""huge_pages: memory for weights and the KV cache in transparent huge pages, 2 MiB-aligned,
no page holding more than its own bytes (THPeligible, AnonHugePages and Rss of the maps,
from /proc/self/smaps), small weights packed into shared arenas that go with their last weight."""

from __future__ import annotations

import pytest
import torch

from shardserve.model import huge_pages
from shardserve.model.attention import allocate_kv_cache
from shardserve.model.huge_pages import (
    ARENA_BYTES,
    HUGE_PAGE,
    huge_page_memory,
    huge_pages_on,
    weight_memory,
)


def map_of(address: int) -> dict[str, int]:
    """The /proc/self/smaps entry holding `address`: its kB fields, THPeligible (1 where the
    kernel may back it with huge pages: advised, or THP `always`) and its bounds."""
    fields: dict[str, int] = {}
    inside = False
    with open("/proc/self/smaps", encoding="ascii") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(v, 16) for v in head.split("-"))
                if inside:
                    break
                inside = lo <= address < hi
                fields = {"start": lo, "end": hi} if inside else {}
            elif inside and (line.rstrip().endswith("kB") or head == "THPeligible:"):
                fields[head.rstrip(":")] = int(line.split()[1])
    return fields


def huge_backed_kib(smaps: dict[str, int], most_kib: int) -> bool:
    """AnonHugePages whole huge pages, at most most_kib: the kernel may fall back to small
    pages where it finds no free huge page (what we control is the advice: THPeligible)."""
    return smaps["AnonHugePages"] % (HUGE_PAGE // 1024) == 0 and \
        smaps["AnonHugePages"] <= most_kib


@pytest.mark.skipif(not huge_pages_on(), reason="no transparent huge pages here")
def test_weight_memory_is_aligned_in_huge_pages_and_exactly_its_bytes() -> None:
    rows, row_bytes = 1000, 3 * HUGE_PAGE // 1000 + 104  # 3 whole huge pages and a tail
    t = weight_memory(rows, row_bytes)
    assert t.shape == (rows, row_bytes) and t.dtype == torch.uint8 and t.is_contiguous()
    assert t.data_ptr() % HUGE_PAGE == 0
    t.fill_(7)  # every page touched
    advised = map_of(t.data_ptr())  # the 3 whole huge pages, and only they, advised
    assert advised["THPeligible"] == 1 and advised["end"] - advised["start"] == 3 * HUGE_PAGE
    assert huge_backed_kib(advised, 3 * HUGE_PAGE // 1024)
    # The tail, with the map's untouched rest (and whatever anonymous map Linux merged with
    # it), in small pages: no page holds more than the weight's own bytes.
    assert map_of(t.data_ptr() + 3 * HUGE_PAGE)["AnonHugePages"] == 0
    assert int(t[-1].sum()) == 7 * row_bytes


def test_weight_memory_unmapped_with_its_last_view() -> None:
    t = weight_memory(4, HUGE_PAGE)
    address, view = t.data_ptr(), t[1:3]
    del t
    assert map_of(address)  # the view keeps the map
    del view
    assert not map_of(address)


@pytest.mark.skipif(not huge_pages_on(), reason="no transparent huge pages here")
def test_small_weights_share_an_arena_that_goes_with_its_last_weight(monkeypatch) -> None:
    monkeypatch.setattr(huge_pages, "_arena", [lambda: None, 0, 0])  # not one a model left
    a, b = weight_memory(3, 100), weight_memory(16, 1024)
    assert b.data_ptr() == a.data_ptr() + 320  # the next 64-byte boundary, same map
    a.fill_(1), b.fill_(2)
    assert int(a.sum()) == 300 and int(b.sum()) == 2 * 16 * 1024
    big = weight_memory(1, ARENA_BYTES)  # past what is left of it: a map of its own
    assert big.data_ptr() % HUGE_PAGE == 0 and not a.data_ptr() <= big.data_ptr() < b.data_ptr()
    address = a.data_ptr()
    del a
    assert map_of(address)
    del b
    assert not map_of(address)
    c = weight_memory(2, 64)  # a new arena, from a huge page's start
    assert c.data_ptr() % HUGE_PAGE == 0


@pytest.mark.skipif(not huge_pages_on(), reason="no transparent huge pages here")
def test_the_kv_cache_is_zero_and_in_huge_pages_where_touched() -> None:
    layers = allocate_kv_cache(2, 64, 16, 8, 128, torch.bfloat16)  # 64 blocks of 64 KiB
    assert all(t.data_ptr() % HUGE_PAGE == 0 for t in layers)
    layers[0][:32] = 1.0  # 2 MiB of blocks written (before any read): one huge page
    smaps = map_of(layers[0].data_ptr())
    assert smaps["THPeligible"] == 1 and huge_backed_kib(smaps, HUGE_PAGE // 1024)
    assert smaps["Rss"] == HUGE_PAGE // 1024  # only what was written
    assert not layers[0][32:].any() and not layers[1].any()


def test_huge_page_memory_without_huge_pages_is_zeroed_plain_memory(monkeypatch) -> None:
    monkeypatch.setenv("SHARDSERVE_HUGE_PAGES", "0")
    t = huge_page_memory(3 * HUGE_PAGE + 5)
    assert t.numel() == 3 * HUGE_PAGE + 5 and not t.any()
    t[-5:] = 9  # writable, and private to this process
    assert int(t.sum()) == 45


def test_the_knob_off_takes_plain_memory(monkeypatch) -> None:
    monkeypatch.setenv("SHARDSERVE_HUGE_PAGES", "0")
    for shape in ((16, 1024), (4, HUGE_PAGE)):
        plain = weight_memory(*shape)
        assert plain.untyped_storage().nbytes() == shape[0] * shape[1]  # torch's, no map
