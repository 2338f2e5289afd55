"""Rewriting GGML blocks in shardserve's R4 / R8 row layouts (csrc/quant_kernels.c draws them)
and T4 / T8 / T4K / T6K tiles of 16 rows (csrc/quant_tiles.c, written by csrc/quant_retile.c), which
the AVX-512 few-rows kernels read faster: the same values and bytes, moved.

R4 / R8 are done with numpy on int16 views of the blocks (the tiles in C): numpy runs each call
on the calling thread with the GIL released, so several weights repack at once on a thread pool
(torch's elementwise ops would each start its own OpenMP team: on 2 cores with other work running
they were 10-30x slower), and the int16 views halve the elements touched.
"""

from __future__ import annotations

import numpy as np
import torch

from shardserve.model import native_kernels

# Nibbles of each byte of an int16 (the low 4 bits of both bytes).
_LOW = 0x0F0F


def _int16_blocks(src: torch.Tensor, blocks: int) -> np.ndarray:
    """src uint8 [rows, row_bytes] as int16 [rows, blocks, block_bytes / 2] (a view)."""
    rows = src.shape[0]
    return src.numpy().view(np.int16).reshape(rows, blocks, -1, copy=False)


def repack_r4(src: torch.Tensor, dst: torch.Tensor, cols: int, has_min: bool) -> None:
    """Q4_1 (has_min) or Q4_0 rows `src` as R4 into `dst` uint8 [rows, cols / 32 * 20]:
    nib byte 32 g + l = q(sub 2g, l) | q(sub 2g+1, l) << 4, then d[cols/32], then m[cols/32]
    (Q4_0's m = -8 d, exact in fp16 short of overflow, as the kernels compute it)."""
    rows, nb = src.shape[0], cols // 32
    blocks = _int16_blocks(src, nb)
    out = dst.numpy().view(np.int16)
    nib = out[:, : cols // 4].reshape(rows, nb // 2, 16, copy=False)  # writes land in dst
    scales, mins = out[:, cols // 4 : cols // 4 + nb], out[:, cols // 4 + nb :]
    scales[:] = blocks[:, :, 0]
    if has_min:
        mins[:] = blocks[:, :, 1]
        qs = blocks[:, :, 2:10]
    else:
        np.multiply(blocks[:, :, 0].view(np.float16), np.float16(-8), out=mins.view(np.float16))
        qs = blocks[:, :, 1:9]
    # Elements 0-15 of a block are qs's low nibbles, 16-31 its high ones; a byte of R4 holds
    # one element of sub-block 2g (low nibble) and the same element of 2g+1 (high nibble).
    for first, values in ((0, qs & _LOW), (8, (qs >> 4) & _LOW)):
        pairs = values.reshape(rows, nb // 2, 2, 8, copy=False)
        np.bitwise_or(pairs[:, :, 0], pairs[:, :, 1] << 4, out=nib[:, :, first : first + 8])


def repack_r8(src: torch.Tensor, dst: torch.Tensor, cols: int) -> None:
    """Q8_0 rows `src` as R8 into `dst` uint8 [rows, cols / 32 * 34]: q[cols], then d[cols/32]."""
    rows, nb = src.shape[0], cols // 32
    blocks = _int16_blocks(src, nb)
    out = dst.numpy().view(np.int16)
    out[:, : cols // 2].reshape(rows, nb, 16, copy=False)[:] = blocks[:, :, 1:]
    out[:, cols // 2 :] = blocks[:, :, 0]


def repack_tiles(src: torch.Tensor, dst: torch.Tensor, cols: int, src_type: int) -> None:
    """Q4_0 / Q4_1 / Q8_0 / Q4_K / Q6_K rows `src` (a multiple of 16) as T4 / T8 / T4K / T6K
    tiles into `dst` uint8 [rows, row bytes] (csrc/quant_retile.c, on this thread: numpy's
    6-dimensional transposes of 2-byte items took ~10x as long)."""
    if src.stride(1) != 1 or not dst.is_contiguous():
        raise ValueError("tiles are written from rows of unit stride into contiguous rows")
    rc = native_kernels.lib().quant_retile(src_type, src.data_ptr(), src.stride(0),
                                           dst.data_ptr(), src.shape[0], cols)
    if rc:
        raise ValueError(f"cannot tile {src.shape[0]} rows of ggml type {src_type} here")
