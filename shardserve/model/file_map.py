"""Tensors that are views of a read-only file map (a GGUF file's weights used where they lie),
and giving the resident pages of a view back once its bytes were copied out.

A view costs no memory of its own: its pages are the page cache's, shared by every process that
maps the file, and count in a process's RSS only once touched. Where a weight had to be
transformed (repacked, its pieces joined), `drop_pages` lets the kernel unmap the source pages
again, so the file's bytes and their copy are not both resident.
"""

from __future__ import annotations

import mmap
import warnings
import weakref

import torch

# Storage address of each file tensor -> its map (weak: a map goes when its last view does).
_MAPS: weakref.WeakValueDictionary[int, mmap.mmap] = weakref.WeakValueDictionary()


def file_tensor(mm: mmap.mmap) -> torch.Tensor:
    """The whole map as a uint8 tensor sharing its memory (no copy).

    The map is read-only (ACCESS_READ), which torch.frombuffer warns about once per process:
    torch has no read-only tensors. Nothing writes into weights (the kernels only read them,
    reloading replaces them), so the warning is silenced here; a write would fault rather than
    silently change the file's bytes for every later load from the same map. The tensor keeps
    `mm` referenced; the map must never be closed while views live (nobody closes it: the GGUF
    reader leaves that to garbage collection).
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        data = torch.frombuffer(mm, dtype=torch.uint8)
    _MAPS[data.data_ptr()] = mm
    return data


def drop_pages(t: torch.Tensor) -> None:
    """Let the kernel take back the whole pages under `t` where `t` is a view of a file map (a
    no-op for any other tensor). Safe while other views of those pages live: a read-only file
    map refaults them from the page cache on the next access."""
    if t.numel() == 0:
        return
    base = t.untyped_storage().data_ptr()
    mm = _MAPS.get(base)
    if mm is None or mm.closed:
        return
    start = t.data_ptr() - base
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
    end = start + t.element_size() * (last + 1)
    page = mmap.PAGESIZE
    lo, hi = -(-start // page) * page, end // page * page  # whole pages only: a neighbour's
    if hi > lo:  # partly shared page stays mapped
        mm.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
