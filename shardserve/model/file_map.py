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


def weight_memory(rows: int, row_bytes: int) -> torch.Tensor:
    """New uint8 [rows, row_bytes] for a weight written at load (repacked, its pieces joined),
    its whole 2 MiB spans advised for transparent huge pages (THP in `madvise` mode, the usual
    default, gives them only where asked).

    Why: a decode step streams every weight once; in 4 KiB pages that stream takes a TLB miss
    every 4 KiB. Measured on a Xeon (AMX class, 2 threads, 64 distinct weights so the products
    come from memory, `quantization.matmul_into` at one row of x): T4K tiles 2048 x 2048 -> 2048
    35.1 GMAC/s in 4 KiB pages, 47.2 in huge pages (1.34x); 8192 x 2048 36.5 -> 51.3 (1.41x);
    the AVX2 Q4_K rows 2048 x 2048 from a file map's pages 36.6, 4 KiB anonymous 28.7, huge 38.8.
    The start is aligned to 2 MiB (the map is one huge page longer; its untouched ends cost no
    memory) and the tail short of a whole huge page is not advised, so no page holds more than
    the weight's own bytes. Unmapped when the last view is freed, as `torch.frombuffer` keeps
    the map. Without huge pages (huge_pages_on) or below one: torch's own small pages.
    """
    nbytes = rows * row_bytes
    if nbytes < HUGE_PAGE or not huge_pages_on():
        return torch.empty(rows, row_bytes, dtype=torch.uint8)
    # MAP_PRIVATE, not Python's default MAP_SHARED: a forked child must not share it.
    buf = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE)
    flat = torch.frombuffer(buf, dtype=torch.uint8)
    lead = -flat.data_ptr() % HUGE_PAGE
    try:
        buf.madvise(mmap.MADV_HUGEPAGE, lead, nbytes // HUGE_PAGE * HUGE_PAGE)
    except OSError:  # THP off in this kernel: small pages, as torch.empty's
        pass
    return flat[lead:lead + nbytes].view(rows, row_bytes)
