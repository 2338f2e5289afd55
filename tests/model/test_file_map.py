"""file_map: a whole read-only map as a tensor without a copy, dropping the resident pages of
views whose bytes were copied out (RssFile read from /proc/self/status), and new weight memory
in transparent huge pages (AnonHugePages of the map, from /proc/self/smaps)."""

from __future__ import annotations

import mmap
from pathlib import Path

import numpy as np
import pytest
import torch

from shardserve.model import file_map
from shardserve.model.file_map import (
    ARENA_BYTES,
    HUGE_PAGE,
    drop_pages,
    file_tensor,
    huge_pages_on,
    weight_memory,
)

SIZE = 8 << 20


def rss_file_kib() -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssFile:"))


@pytest.fixture
def mapped(tmp_path: Path):
    path = tmp_path / "blob.bin"
    data = np.random.default_rng(0).integers(0, 256, SIZE, dtype=np.uint8)
    path.write_bytes(data.tobytes())
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    return mm, data


def test_the_tensor_is_the_map_itself(mapped) -> None:
    mm, data = mapped
    t = file_tensor(mm)
    address = np.frombuffer(mm, dtype=np.uint8).ctypes.data
    assert t.data_ptr() == address and t.numel() == SIZE
    assert torch.equal(t[1000:1100], torch.from_numpy(data[1000:1100]))


def test_dropped_pages_leave_rss_and_read_back_the_same(mapped) -> None:
    mm, data = mapped
    t = file_tensor(mm)
    view = t.narrow(0, 104, SIZE - 208).view(-1, 8)  # not page aligned: inner pages go
    before = rss_file_kib()
    assert int(view.sum()) == int(data[104:-104].sum())  # touch every page
    touched = rss_file_kib()
    drop_pages(view)
    dropped = rss_file_kib()
    assert touched - before > 0.9 * SIZE / 1024  # kernel pages were really mapped in
    assert touched - dropped > 0.9 * SIZE / 1024
    assert torch.equal(view, torch.from_numpy(data[104:-104]).view(-1, 8))  # refaulted


def test_other_tensors_are_left_alone() -> None:
    t = torch.arange(1 << 20, dtype=torch.int32)  # 4 MiB of anonymous memory
    drop_pages(t)  # MADV_DONTNEED would zero anonymous pages: must not be applied
    assert torch.equal(t, torch.arange(1 << 20, dtype=torch.int32))


def map_of(address: int) -> dict[str, int]:
    """The kB fields of the /proc/self/smaps entry holding `address`."""
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
            elif inside and line.rstrip().endswith("kB"):
                fields[head.rstrip(":")] = int(line.split()[1])
    return fields


@pytest.mark.skipif(not huge_pages_on(), reason="no transparent huge pages here")
def test_weight_memory_is_aligned_in_huge_pages_and_exactly_its_bytes() -> None:
    rows, row_bytes = 1000, 3 * HUGE_PAGE // 1000 + 104  # 3 whole huge pages and a tail
    t = weight_memory(rows, row_bytes)
    assert t.shape == (rows, row_bytes) and t.dtype == torch.uint8 and t.is_contiguous()
    assert t.data_ptr() % HUGE_PAGE == 0
    t.fill_(7)  # every page touched
    smaps = map_of(t.data_ptr())
    assert smaps["AnonHugePages"] == 3 * HUGE_PAGE // 1024  # the tail is in small pages
    assert smaps["Rss"] <= -(-rows * row_bytes // 4096) * 4  # nothing beyond its own bytes
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
    monkeypatch.setattr(file_map, "_arena", [lambda: None, 0, 0])  # not one a model left
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


def test_the_knob_off_takes_plain_memory(monkeypatch) -> None:
    monkeypatch.setenv("SHARDSERVE_HUGE_PAGES", "0")
    for shape in ((16, 1024), (4, HUGE_PAGE)):
        plain = weight_memory(*shape)
        assert plain.untyped_storage().nbytes() == shape[0] * shape[1]  # torch's, no map
