"""Memory in transparent huge pages (2 MiB) for what every step streams: the weights written at
load (repacked, their pieces joined, or copied out of the file's small pages) and the KV cache.

Why: a step streams every weight once (and, at long contexts, much of the KV cache); in 4 KiB
pages that stream takes a TLB miss every 4 KiB. Measured on a Xeon (AMX class, 2 threads, 64
distinct weights so the products come from memory, `quantization.matmul_into` at one row of x):
T4K tiles 2048 x 2048 -> 2048 35.1 GMAC/s in 4 KiB pages, 47.2 in huge pages (1.34x); 8192 x
2048 36.5 -> 51.3 (1.41x); the AVX2 Q4_K rows 2048 x 2048 from a file map's pages 36.6, 4 KiB
anonymous 28.7, huge 38.8. The 1B Q4_K_M at batch 8 and a 1,500-token context: 1.07x with
the KV cache in huge pages.

Linux gives them where asked (THP in `madvise` mode, the usual default) or always; every map here
starts on a 2 MiB boundary (it is one huge page longer; its untouched ends cost no memory) and
only its whole huge pages are advised, so no page holds more than the map's own bytes.
SHARDSERVE_HUGE_PAGES=0 turns it off (torch's own small pages).
"""

from __future__ import annotations

import functools
import mmap
import threading
import weakref

import torch

from shardserve import envs

HUGE_PAGE = 2 << 20  # x86-64's transparent huge page


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
    """Whether this module gives huge pages: SHARDSERVE_HUGE_PAGES on (the default) and THP in
    `madvise` or `always` mode."""
    return envs.huge_pages() and hasattr(mmap, "MADV_HUGEPAGE") and \
        _thp_mode() in ("madvise", "always")


def _huge_map(nbytes: int) -> tuple[mmap.mmap, int]:
    """A new private anonymous map holding nbytes from a 2 MiB boundary (its offset returned),
    the whole huge pages of those bytes advised for THP. Zero until written, and resident only
    where touched. MAP_PRIVATE, not Python's default MAP_SHARED: a forked child must not share
    it."""
    buf = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE)
    lead = -torch.frombuffer(buf, dtype=torch.uint8).data_ptr() % HUGE_PAGE
    try:
        buf.madvise(mmap.MADV_HUGEPAGE, lead, nbytes // HUGE_PAGE * HUGE_PAGE)
    except OSError:  # THP off in this kernel after all: small pages
        pass
    return buf, lead


def _view(buf: mmap.mmap, start: int, nbytes: int) -> torch.Tensor:
    """uint8 [nbytes] at `start` of buf; the tensor keeps buf mapped (frombuffer holds it): a
    map is unmapped when the last view of it is freed."""
    return torch.frombuffer(buf, dtype=torch.uint8)[start:start + nbytes]


def huge_page_memory(nbytes: int) -> torch.Tensor:
    """uint8 [nbytes] of zeroed memory (zero-filled on first touch, like any anonymous map) in a
    map of its own, 2 MiB-aligned, in huge pages where huge_pages_on says so and it fills one."""
    if nbytes < HUGE_PAGE or not huge_pages_on():
        buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE)
        return torch.frombuffer(buf, dtype=torch.uint8)
    buf, lead = _huge_map(nbytes)
    return _view(buf, lead, nbytes)


# Weights under a huge page share maps of ARENA_BYTES, filled in order: [map, next free byte,
# end]. The map is held weakly, so it goes with the last weight in it (a model freed by
# sleep(2) or deleted leaves nothing mapped).
ARENA_BYTES = 16 * HUGE_PAGE
_arena_lock = threading.Lock()
_arena: list = [lambda: None, 0, 0]


def weight_memory(rows: int, row_bytes: int) -> torch.Tensor:
    """New uint8 [rows, row_bytes] for a weight written at load: a weight of a huge page or more
    in a map of its own (huge_page_memory), smaller ones packed (64-byte aligned) into shared
    maps of ARENA_BYTES; torch's own memory where huge_pages_on says no."""
    nbytes = rows * row_bytes
    if nbytes == 0 or not huge_pages_on():
        return torch.empty(rows, row_bytes, dtype=torch.uint8)
    if nbytes >= HUGE_PAGE:
        return huge_page_memory(nbytes).view(rows, row_bytes)
    with _arena_lock:
        buf, start, end = _arena[0](), -(-_arena[1] // 64) * 64, _arena[2]
        if buf is None or start + nbytes > end:
            buf, start = _huge_map(ARENA_BYTES)
            end = start + ARENA_BYTES
        _arena[:] = [weakref.ref(buf), start + nbytes, end]
        return _view(buf, start, nbytes).view(rows, row_bytes)
