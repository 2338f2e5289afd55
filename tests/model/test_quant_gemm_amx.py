"""The panel GEMM's bfloat16 products on AMX tiles (csrc/quant_gemm_amx.c), where the CPU has
AMX-BF16 (Sapphire Rapids and later) and the kernel grants the tile state.

Oracle: the gguf package's dequantized weights rounded to bfloat16 (as the panels hold them),
times the bfloat16 x in float64. AMX sums those products in float32, as vdpbf16ps does in
another order: both agree with the oracle to float32 rounding (relative 1e-5 of the largest
output; seen 1-4e-7) and with each other. Where the CPU has no AMX, what runs elsewhere is
checked: the builds without it report it off and the row limits stay the AVX-512 ones.
"""

from __future__ import annotations

import pytest
import torch
from test_quantization import random_blocks, reference, rel_err

from shardserve.model import kernel_levels
from shardserve.model import native_kernels as nk
from shardserve.model import quant_rows_max as qr
from shardserve.model import quant_types as qt
from shardserve.model import quantization as q

pytestmark = pytest.mark.skipif(not nk.compiler_available(), reason="no C compiler")

HAS_AMX = kernel_levels.X86 and "amx_bf16" in kernel_levels.cpu_flags()


@pytest.fixture
def amx_lib(native_kernels_on):
    lib = nk.library()
    if lib is None or not lib.gemm_amx_ready():
        pytest.skip("this CPU or kernel has no AMX-BF16 (nothing of it to run here)")
    with nk.using(lib):
        yield lib
    lib.gemm_amx_set(1)


def _gemm(w: q.QuantizedTensor, x: torch.Tensor, width: int) -> torch.Tensor:
    """gemm_into on a column range of a wider output (nothing beside it may be written)."""
    out = torch.full((x.shape[0], width + 20), 7.0)
    q.gemm_into(out.narrow(1, 9, width), x, w)
    assert (out[:, :9] == 7).all() and (out[:, 9 + width:] == 7).all()
    return out[:, 9:9 + width]


@pytest.mark.parametrize("ggml_type", [3, 8, 12, 14], ids=["Q4_1", "Q8_0", "Q4_K", "Q6_K"])
@pytest.mark.parametrize("tiled", [False, True], ids=["rows", "tiles"])
@pytest.mark.parametrize("rows", [1, 16, 23, 40])  # one block of x, a whole one, odd blocks
def test_amx_products_agree_with_the_bf16_weights(amx_lib, ggml_type, tiled, rows):
    """K past one panel chunk (2,048) and not a multiple of it, N not a multiple of the 32 rows
    a panel holds, x a column range of a wider tensor."""
    n = 48 if tiled else 53  # tiles: rows in multiples of 16
    w = random_blocks(ggml_type, n, 4608, seed=ggml_type)
    wide = torch.randn(rows, 4608 + 64, generator=torch.Generator().manual_seed(rows))
    x = wide.bfloat16()[:, 32:32 + 4608]
    want = x.double() @ reference(w).bfloat16().double().T
    if tiled:
        w = q.repack(w)
        assert w.ggml_type != ggml_type
    got = _gemm(w, x, n)
    assert rel_err(got, want) < 1e-5
    amx_lib.gemm_amx_set(0)  # the vdpbf16ps panels, for the same products
    try:
        assert rel_err(_gemm(w, x, n), got) < 1e-5
    finally:
        assert amx_lib.gemm_amx_set(1) == 1


@pytest.mark.parametrize("level", nk.levels_buildable_here())
def test_amx_is_on_where_the_build_and_cpu_have_it_and_the_knob_turns_it_off(
        monkeypatch, native_kernels_on, level):
    monkeypatch.setenv("SHARDSERVE_ISA", level)
    lib = nk.library()
    on = level == "native" and HAS_AMX
    assert bool(lib.gemm_amx_ready()) == on
    with nk.using(lib):
        assert qr.gemm_amx() == on
        if qr.gemm_int16(qt.T4K):  # AVX2 levels: T4K's rows hand over to the int16 GEMM
            assert qr.rows_max(qt.T4K, torch.bfloat16) == qr.ROWS_MAX_INT16_GEMM
            assert qr.rows_max(qt.T4K, torch.float32) == qr.ROWS_MAX_INT16_GEMM
        else:
            want = qr.ROWS_MAX_AMX_KQUANT if on else qr.ROWS_MAX_TILES_KQUANT
            assert qr.rows_max(qt.T4K, torch.bfloat16) == want
            assert qr.rows_max(qt.T4K, torch.float32) == qr.ROWS_MAX_F32_KQUANT  # no AMX
    monkeypatch.setenv("SHARDSERVE_AMX", "0")
    nk.library.cache_clear()
    off = nk.library()
    try:
        assert not off.gemm_amx_ready()
        with nk.using(off):
            assert not qr.gemm_amx()
    finally:  # one library file is one state in this process, whichever handle turned it off
        assert bool(off.gemm_amx_set(1)) == on
