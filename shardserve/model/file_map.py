"""Where the weights' bytes lie: tensors that are views of a read-only file map (a GGUF file's
weights used where they lie), giving the resident pages of a view back once its bytes were
copied out, and new memory in huge pages for the weights written at load.

A view costs no memory of its own: its pages are the page cache's, shared by every process that
maps the file, and count in a process's RSS only once touched. Where a weight had to be
transformed (repacked, its pieces joined), `drop_pages` lets the kernel unmap the source pages
again, so the file's bytes and their copy are not both resident.
"""

from __future__ import annotations

import functools
import mmap
import threading
import warnings
import weakref

import torch

from shardserve import envs

HUGE_PAGE = 2 << 20  # x86-64's transparent huge page

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


@functools.cache
def _thp_mode() -> str:
    """The bracketed mode of Linux's transparent huge pages ('' where there are none)."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled", encoding="ascii") as f:
            text = f.read()
    except OSError:
        return ""
    return text.split("[")[1].split("]")[0] if "[" in text else ""


def huge_pages_on() -> bool:
    """Whether weight_memory gives huge pages: SHARDSERVE_HUGE_PAGES on (the default) and THP
    in `madvise` or `always` mode."""
    return envs.huge_pages() and hasattr(mmap, "MADV_HUGEPAGE") and \
        _thp_mode() in ("madvise", "always")


def _huge_map(nbytes: int) -> tuple[mmap.mmap, int]:
    """A new private anonymous map of nbytes from a 2 MiB boundary (its offset returned; the map
    is one huge page longer, its untouched ends costing no memory), the whole huge pages of it
    advised for THP; the tail short of one is not, so no page holds more than those bytes.
    MAP_PRIVATE, not Python's default MAP_SHARED: a forked child must not share it."""
    buf = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE)
    lead = -_address(buf) % HUGE_PAGE
    try:
        buf.madvise(mmap.MADV_HUGEPAGE, lead, nbytes // HUGE_PAGE * HUGE_PAGE)
    except OSError:  # THP off in this kernel after all: small pages
        pass
    return buf, lead


def _address(buf: mmap.mmap) -> int:
    return torch.frombuffer(buf, dtype=torch.uint8).data_ptr()


def _view(buf: mmap.mmap, start: int, rows: int, row_bytes: int) -> torch.Tensor:
    """uint8 [rows, row_bytes] at `start` of buf; the tensor keeps buf mapped (frombuffer
    holds it): a map is unmapped when the last view of it is freed."""
    flat = torch.frombuffer(buf, dtype=torch.uint8)
    return flat[start:start + rows * row_bytes].view(rows, row_bytes)


# Weights under a huge page share maps of ARENA_BYTES, filled in order: [map, next free byte,
# end]. The map is held weakly, so it goes with the last weight in it (a model freed by
# sleep(2) or deleted leaves nothing mapped).
ARENA_BYTES = 16 * HUGE_PAGE
_arena_lock = threading.Lock()
_arena: list = [lambda: None, 0, 0]


def weight_memory(rows: int, row_bytes: int) -> torch.Tensor:
    """New uint8 [rows, row_bytes] for a weight written at load (repacked, its pieces joined)
    in transparent huge pages (THP in `madvise` mode, the usual default, gives them only where
    asked): a weight of a huge page or more in a map of its own from a 2 MiB boundary, smaller
    ones packed (64-byte aligned) into shared maps of ARENA_BYTES.

    Why: a decode step streams every weight once; in 4 KiB pages that stream takes a TLB miss
    every 4 KiB. Measured on a Xeon (AMX class, 2 threads, 64 distinct weights so the products
    come from memory, `quantization.matmul_into` at one row of x): T4K tiles 2048 x 2048 -> 2048
    35.1 GMAC/s in 4 KiB pages, 47.2 in huge pages (1.34x); 8192 x 2048 36.5 -> 51.3 (1.41x);
    the AVX2 Q4_K rows 2048 x 2048 from a file map's pages 36.6, 4 KiB anonymous 28.7, huge 38.8.
    Without huge pages (huge_pages_on): torch's own small pages.
    """
    nbytes = rows * row_bytes
    if nbytes == 0 or not huge_pages_on():
        return torch.empty(rows, row_bytes, dtype=torch.uint8)
    if nbytes >= HUGE_PAGE:
        buf, lead = _huge_map(nbytes)
        return _view(buf, lead, rows, row_bytes)
    with _arena_lock:
        buf, start, end = _arena[0](), -(-_arena[1] // 64) * 64, _arena[2]
        if buf is None or start + nbytes > end:
            buf, start = _huge_map(ARENA_BYTES)
            end = start + ARENA_BYTES
        _arena[:] = [weakref.ref(buf), start + nbytes, end]
        return _view(buf, start, rows, row_bytes)
