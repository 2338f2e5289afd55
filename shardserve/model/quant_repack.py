"""Rewriting GGML blocks in shardserve's R4 / R8 row layouts (csrc/quant_kernels.c draws them)
and T4 / T8 tiles of 16 rows (csrc/quant_tiles.c), which the AVX-512 few-rows kernels read
faster: the same values and bytes, moved.

Done with numpy on int16 views of the blocks: numpy runs each call on the calling thread with
the GIL released, so several weights repack at once on a thread pool (torch's elementwise ops
would each start its own OpenMP team: on 2 cores with other work running they were 10-30x
slower), and the int16 views halve the elements touched. ~0.3 s for the default model's 92 MB.
"""

from __future__ import annotations

import numpy as np
import torch

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


def repack_t4(src: torch.Tensor, dst: torch.Tensor, cols: int, has_min: bool) -> None:
    """Q4_1 (has_min) or Q4_0 rows `src` (a multiple of 16) as T4 tiles into `dst` uint8
    [rows, cols / 32 * 20]: per tile of 16 rows and block g, the 16 rows' qs bytes with byte
    2 c + e of row r at 32 c + 2 r + e, then the 16 d, then the 16 m (csrc/quant_tiles.c)."""
    rows, nb = src.shape[0], cols // 32
    tiles = rows // 16
    blocks = src.numpy().reshape(rows, nb, -1)
    out = dst.numpy().reshape(tiles, nb, 320)
    first = 4 if has_min else 2
    qs = blocks[:, :, first : first + 16].reshape(tiles, 16, nb, 8, 2)
    out[:, :, :256].reshape(tiles, nb, 8, 16, 2, copy=False)[:] = qs.transpose(0, 2, 3, 1, 4)
    d = blocks[:, :, 0:2]
    if has_min:
        m = blocks[:, :, 2:4]
    else:  # Q4_0's m = -8 d, as repack_r4 writes it
        m = (np.ascontiguousarray(d).view(np.float16) * np.float16(-8)).view(np.uint8)
    for at, values in ((256, d), (288, m)):
        per_tile = values.reshape(tiles, 16, nb, 2).transpose(0, 2, 1, 3)
        out[:, :, at : at + 32].reshape(tiles, nb, 16, 2, copy=False)[:] = per_tile


def repack_t8(src: torch.Tensor, dst: torch.Tensor, cols: int) -> None:
    """Q8_0 rows `src` (a multiple of 16) as T8 tiles into `dst` uint8 [rows, cols / 32 * 34]:
    per tile and block g, the 16 rows' qs with byte 2 p + e of row r at 32 p + 2 r + e, then
    the 16 d (csrc/quant_tiles.c)."""
    rows, nb = src.shape[0], cols // 32
    tiles = rows // 16
    blocks = src.numpy().reshape(rows, nb, 34)
    out = dst.numpy().reshape(tiles, nb, 544)
    qs = blocks[:, :, 2:].reshape(tiles, 16, nb, 16, 2)
    out[:, :, :512].reshape(tiles, nb, 16, 16, 2, copy=False)[:] = qs.transpose(0, 2, 3, 1, 4)
    d = blocks[:, :, 0:2].reshape(tiles, 16, nb, 2).transpose(0, 2, 1, 3)
    out[:, :, 512:].reshape(tiles, nb, 16, 2, copy=False)[:] = d


def repack_t4k(src: torch.Tensor, dst: torch.Tensor, cols: int) -> None:
    """Q4_K rows `src` (a multiple of 16) as T4K tiles into `dst` uint8 [rows, cols / 256 *
    144]: per tile and block, the 16 rows' qs with byte 32 p + 2 t + e of row r at 512 p + 32 t
    + 2 r + e, then the 16 d, the 16 dmin, and the 12 scale bytes as three words per row
    (csrc/quant_tiles.c)."""
    rows, nb = src.shape[0], cols // 256
    tiles = rows // 16
    blocks = src.numpy().reshape(rows, nb, 144)
    out = dst.numpy().reshape(tiles, nb, 2304)
    qs = blocks[:, :, 16:].reshape(tiles, 16, nb, 4, 16, 2)
    nib = out[:, :, :2048].reshape(tiles, nb, 4, 16, 16, 2, copy=False)
    nib[:] = qs.transpose(0, 2, 3, 4, 1, 5)
    # d, dmin (2 bytes each), then the scale words (4 bytes each): per field, 16 rows side by side
    for first, size, at in ((0, 2, 2048), (2, 2, 2080), (4, 4, 2112), (8, 4, 2176), (12, 4, 2240)):
        field = blocks[:, :, first : first + size].reshape(tiles, 16, nb, size)
        out[:, :, at : at + 16 * size].reshape(tiles, nb, 16, size, copy=False)[:] = \
            field.transpose(0, 2, 1, 3)
