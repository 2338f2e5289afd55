"""Which kernel a product with a quantized weight takes, by the rows of x it has: the row
kernels (csrc/quant_rows.c, the tiles' quant_tiles*.c) up to rows_max rows, the panel GEMM
(csrc/quant_gemm.c: float32 / bfloat16 panels, AMX tiles, or int16 products on AVX2) past them.
The thresholds are measured, and the measurements are written beside them.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from shardserve.model import native_kernels
from shardserve.model.quant_types import KQUANTS, T4K, T6K, TILED

# Up to rows_max(...) rows of x a product runs the row kernels (quant_rows.c: a weight row
# decoded in registers, multiplied with up to 8 rows of x a pass; FUSED_MAX_B in
# csrc/quant_blocks.h), from one more on the panel GEMM (quant_gemm.c: weights decoded once per
# call into float32 panels, or bfloat16 ones multiplied pairwise by vdpbf16ps on AVX512_BF16).
# Measured on AVX-512 (random blocks, 2 threads; GEMM time over rows time): at 5 rows the rows
# win for every type and x dtype (0.3-0.9x); at 8 they win with float32 x (0.6-0.9x) but not
# always with bfloat16 x (0.95-1.5x, the GEMM's bf16 dot); with float32 x the K-quants' rows
# still win at 32 (0.75-0.98x: their panels decode slowly).
# The tiles (T4 / T8 / T4K / T6K, csrc/quant_tiles.c) pay the float step once per 16 weight
# rows: with bfloat16 x they took 0.43-0.85x the GEMM's time at 8 rows and 0.67-0.89x at 16
# (two passes of 8; default model's and 1B's shapes, Zen 4); at 1B's 2048 -> 8192 from memory
# (4 distinct weights, 2 threads, 2026-12-06) T4K / T6K 0.76x / 0.65x at 16 rows, 0.95x /
# 0.78x at 24, 0.93x / 0.90x at 32, 0.99x / 1.04x at 48, 1.04x / 1.12x at 64; T4K / T6K with
# float32 x as the K-quants. T4 / T8 at the default model's shapes (bfloat16 x): 0.79-0.85x at
# 32 rows at 3072 x 576 but 1.12-1.17x at 576 x 1536 (0.88-0.96x at 16), so they stay at 16.
# Where the GEMM multiplies with int16 x (AVX2 builds, csrc/quant_gemm_i16.c) it beat the rows
# from 16 rows on (Zen 4 at x86-64-v3, 1B shapes, 2 threads: Q4_K 1.35x, Q6_K 1.8x at 16 rows;
# the rows still win at 8: 0.7x-0.95x). AVX2 builds' tiles (T4, T8, T4K; csrc/quant_tiles_avx2.c)
# hand over to it past 8 too: T4K's rows at 8 / 12 / 16 / 32 rows of x took 0.76x / 1.01x /
# 1.06x / 1.09x the GEMM's time (Zen 3, 2 threads, 1B shapes). T6K's (quant_tiles_k6_avx2.c)
# hand over from 3 rows: they took 0.53x / 0.65x the GEMM's time at 1 / 2 rows; the GEMM took
# 0.98-0.99x theirs at 3, 0.81-1.05x at 4, 0.79-0.80x at 5 and 0.75x at 8 (same machine and
# shapes).
ROWS_MAX_INT16_GEMM = 8
ROWS_MAX_INT16_GEMM_T6K = 2
ROWS_MAX_BF16 = 5
ROWS_MAX_F32 = 8
ROWS_MAX_F32_KQUANT = 32
ROWS_MAX_TILES = 16
ROWS_MAX_TILES_KQUANT = 32
# Where the GEMM's bfloat16 products run on AMX (csrc/quant_gemm_amx.c) they cost little beside
# decoding the weights, and the K-quant tiles' rows lose past 16 (Sapphire Rapids, 2 threads,
# 1B's 2048 -> 8192 from memory, GEMM over rows GMAC/s: T4K 1.00x at 16 rows, 1.38x at 24,
# 1.92x at 32; T6K 0.84x at 16, 1.30x at 24, 1.62x at 32). T4 / T8 stay at 16 (0.5-0.6x at 16
# rows at the default model's shapes, 0.8x at 24, 1.15-1.4x at 32).
ROWS_MAX_AMX_KQUANT = 16
_KQUANT_ROWS = KQUANTS | {T4K, T6K}  # the K-quants and their tiles: rows_max with float32 x


def rows_max(ggml_type: int, x_dtype: torch.dtype) -> int:
    """The most rows of x whose product with a weight of this type takes the row kernels."""
    if gemm_int16(ggml_type):
        return ROWS_MAX_INT16_GEMM_T6K if ggml_type == T6K else ROWS_MAX_INT16_GEMM
    if x_dtype != torch.float32:
        if ggml_type in (T4K, T6K):
            return ROWS_MAX_AMX_KQUANT if gemm_amx() else ROWS_MAX_TILES_KQUANT
        return ROWS_MAX_TILES if ggml_type in TILED else ROWS_MAX_BF16
    return ROWS_MAX_F32_KQUANT if ggml_type in _KQUANT_ROWS else ROWS_MAX_F32


def gemm_amx() -> bool:
    """Whether gemm_into multiplies bfloat16 x on AMX tiles (csrc/quant_gemm_amx.c: a build with
    AMX-BF16, a kernel that grants the tile state, SHARDSERVE_AMX not 0); False without the
    kernels."""
    try:
        lib = native_kernels.lib()
    except RuntimeError:
        return False
    return _gemm_amx(lib)


@functools.cache
def _gemm_amx(lib: ctypes.CDLL) -> bool:
    return bool(lib.gemm_amx_ready())


def gemm_int16(ggml_type: int) -> bool:
    """Whether gemm_into multiplies weights of this type with x quantized to int16 (the AVX2
    builds: csrc/quant_gemm_i16.c), at the integer path's precision; else float32 panels (and
    False without the kernels)."""
    try:
        lib = native_kernels.lib()
    except RuntimeError:
        return False
    return _gemm_int16(lib, ggml_type)


@functools.cache
def _gemm_int16(lib: ctypes.CDLL, ggml_type: int) -> bool:
    return bool(lib.quant_gemm_int16(ggml_type))
