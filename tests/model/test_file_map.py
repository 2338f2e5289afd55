"""file_map: a whole read-only map as a tensor without a copy, and dropping the resident pages
of views whose bytes were copied out (RssFile read from /proc/self/status)."""

from __future__ import annotations

import mmap
from pathlib import Path

import numpy as np
import pytest
import torch

from shardserve.model.file_map import drop_pages, file_tensor

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
