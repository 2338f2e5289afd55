"""The block types a weight is kept in: the GGUF types kept quantized and shardserve's own
layouts of them (rows with their scales gathered, tiles of 16 rows), as ggml-style type ids with
their elements and bytes per block. The kernels (csrc/quant_blocks.h's T_* ids) use the same ids.
"""

from __future__ import annotations

# ggml type id -> (name, elements per block, bytes per block): the types kept quantized.
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    8: ("Q8_0", 32, 34),
    12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210),
}
Q4_0, Q4_1, Q8_0, Q4_K, Q6_K = 2, 3, 8, 12, 14
# shardserve's row layouts for the batch-1 path (quant_kernels.c's header draws them): the same
# values and bytes as their source, scales gathered at the row's end.
# T4 / T8 / T4K / T6K: Q4_0 / Q4_1 / Q8_0 / Q4_K / Q6_K in tiles of 16 rows for the few-rows
# products (csrc/quant_tiles.c draws them), where the rows come in multiples of 16; a tile holds
# 16 rows' bytes, so row n's bytes are not row n of the data.
R4, R8, T4, T8, T4K, T6K = 1004, 1008, 1104, 1108, 1112, 1114
REPACKED: dict[int, tuple[str, int, int]] = {
    R4: ("R4", 32, 20), R8: ("R8", 32, 34), T4: ("T4", 32, 20), T8: ("T8", 32, 34),
    T4K: ("T4K", 256, 144), T6K: ("T6K", 256, 210)}
TILED = frozenset((T4, T8, T4K, T6K))
TILE_OF = {Q4_0: T4, Q4_1: T4, Q8_0: T8, Q4_K: T4K, Q6_K: T6K}
# The K-quants: blocks of 256 elements, a scale per 16 or 32 of them.
KQUANTS = frozenset(t for t, (_, elems, _) in GGML_TYPES.items() if elems == 256)


def layout(ggml_type: int) -> tuple[str, int, int]:
    """(name, elements per block, bytes per block) of a GGUF type or one of shardserve's."""
    return GGML_TYPES.get(ggml_type) or REPACKED[ggml_type]
