"""quant_repack: Q4_0 / Q4_1 / Q8_0 rows rewritten as R4 / R8 / T4 hold the same values (the
kernels' own dequantization of both layouts, any build) and land in the rows they are given."""

from __future__ import annotations

import pytest
import torch

from shardserve.model import native_kernels as nk
from shardserve.model import quant_repack
from shardserve.model import quant_rows_max as qr
from shardserve.model import quant_types as qt
from shardserve.model import quantization as q
from tests.model.test_quantization import random_blocks

pytestmark = pytest.mark.skipif(not nk.compiler_available(), reason="no C compiler")


@pytest.mark.parametrize("ggml_type", [qt.Q4_0, qt.Q4_1, qt.Q8_0], ids=["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("cols", [64, 576, 1536])
def test_repacked_rows_hold_the_same_values(ggml_type: int, cols: int) -> None:
    w = random_blocks(ggml_type, 11, cols, seed=cols + ggml_type)
    kind, block_bytes = (qt.R8, 34) if ggml_type == qt.Q8_0 else (qt.R4, 20)  # bytes per 32
    out = torch.full((15, cols // 32 * block_bytes), 7, dtype=torch.uint8)
    dst = out.narrow(0, 2, 11)  # rows of a larger buffer, as a joined segment's are
    if ggml_type == qt.Q8_0:
        quant_repack.repack_r8(w.data, dst, cols)
    else:
        quant_repack.repack_r4(w.data, dst, cols, has_min=ggml_type == qt.Q4_1)
    repacked = q.QuantizedTensor(dst, kind, cols, ggml_type)
    assert torch.equal(repacked.dequantize(), w.dequantize())
    assert (out[:2] == 7).all() and (out[13:] == 7).all()  # nothing written outside dst


TILED = {qt.Q4_0: qt.T4, qt.Q4_1: qt.T4, qt.Q8_0: qt.T8, qt.Q4_K: qt.T4K, qt.Q6_K: qt.T6K}


@pytest.mark.parametrize("ggml_type", TILED, ids=["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K"])
@pytest.mark.parametrize("cols", [32, 576, 1536])
def test_tiles_of_16_rows_hold_the_same_values(ggml_type: int, cols: int) -> None:
    cols = cols * 8 if ggml_type in (qt.Q4_K, qt.Q6_K) else cols  # whole blocks of 256
    w = random_blocks(ggml_type, 48, cols, seed=cols + ggml_type)
    kind = TILED[ggml_type]
    row_bytes = {qt.T4K: cols // 256 * 144, qt.T6K: cols // 256 * 210,
                 qt.T8: cols // 32 * 34}.get(kind, cols // 32 * 20)
    out = torch.full((80, row_bytes), 7, dtype=torch.uint8)
    dst = out.narrow(0, 16, 48)  # a tile-aligned piece of a larger buffer
    quant_repack.repack_tiles(w.data, dst, cols, ggml_type)
    tiled = q.QuantizedTensor(dst, kind, cols, ggml_type)
    assert torch.equal(tiled.dequantize(), w.dequantize())
    ids = torch.tensor([47, 0, 17, 17, 30])
    assert torch.equal(q.dequantize_rows(tiled, ids, torch.float32),
                       q.dequantize_rows(w, ids, torch.float32))
    assert (out[:16] == 7).all() and (out[64:] == 7).all()  # nothing written outside dst


def test_a_tiled_weight_refuses_to_cut_a_tile() -> None:
    w = random_blocks(qt.Q4_1, 32, 64, seed=1)
    tiled = q.QuantizedTensor(torch.empty_like(w.data), qt.T4, 64, qt.Q4_1)
    assert tiled.narrow_rows(16, 16).shape == (16, 64)
    with pytest.raises(ValueError, match="tiles of 16"):
        tiled.narrow_rows(8, 16)
    with pytest.raises(ValueError, match="pick rows before repacking"):
        tiled.index_rows(torch.tensor([0, 1]))


def test_shardserve_tiles_0_keeps_the_file_layout(monkeypatch) -> None:
    """SHARDSERVE_TILES=0 (envs.tiles): no tile where the build would make one (an AVX2 build's
    Q4_0 / Q4_1 / Q8_0 / Q4_K, an AVX-512 build's every tiled type)."""
    lib = nk.lib()
    w = random_blocks(qt.Q4_1, 32, 64, seed=3)
    if not lib.quant_tile_takes(qt.Q4_1):
        pytest.skip("this build tiles no Q4_1")
    assert q.repacked_type(w) == qt.T4
    monkeypatch.setenv("SHARDSERVE_TILES", "0")
    assert q.repacked_type(w) != qt.T4
    assert q.repack(w).ggml_type in (qt.Q4_1, qt.R4)  # the file's layout, or R4 on AVX-512


@pytest.mark.parametrize("ggml_type", [qt.Q4_1, qt.Q8_0, qt.Q4_K], ids=["Q4_1", "Q8_0", "Q4_K"])
def test_the_int16_gemm_takes_tiles_as_it_takes_their_blocks(ggml_type: int) -> None:
    """An AVX2 build's int16 GEMM (csrc/quant_gemm_i16.c) writes its panels straight from T4 /
    T8 / T4K tiles: the same integers and scales as from the blocks, bit for bit, over several
    of its 512-column chunks (1280 columns: a chunk boundary inside a K-quant block pair)."""
    lib = nk.lib()
    tile = TILED[ggml_type]
    if not lib.quant_tile_takes(ggml_type) or not qr.gemm_int16(tile):
        pytest.skip("this build's GEMM does not take these tiles as int16 panels")
    w = random_blocks(ggml_type, 48, 1280, seed=ggml_type)
    tiled = q.repack(w)
    assert tiled.ggml_type == tile
    for rows in (9, 40):
        x = torch.randn(rows, 1280, generator=torch.Generator().manual_seed(rows))
        got, want = torch.empty(rows, 48), torch.empty(rows, 48)
        q.gemm_into(got, x, tiled)
        q.gemm_into(want, x, w)
        assert torch.equal(got, want), rows
