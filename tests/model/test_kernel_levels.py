"""The ISA levels (model/kernel_levels.py): SHARDSERVE_ISA, what a build reports, every
level's quantized kernels against the portable build's, and its SwiGLU activation (a vector exp
per level) against torch's.

For each quantized weight (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K from random blocks; int8 = per
output channel in the Q8_0 layout), each level this CPU runs besides portable, and each entry point
in ENTRY_POINTS, the result under that level's library is compared with the portable build's on the
same blocks and x (1, 5 and 11 rows: row-kernel passes of 1, 5 and 8 + 3; float32 and bfloat16). The
weight is built under each level, so where a level repacks (AVX-512: Q4_0 / Q4_1 in tiles of 16
rows as T4, Q8_0 and int8 as T8, Q4_K as T4K, Q6_K as T6K; where the weight comes in pieces of
other row counts, "(pieces)", as R4 / R8 / the K-quants' own rows) its T4 / T8 / T4K / T6K / R4 /
R8 kernels are what runs. How close each must be
depends on what was computed (`kind`, the looser of the two sides'):
- EXACT, bit for bit: the dequantized weights. Every level decodes a block to the same integers
  and scales and computes s * q + m once per element; s * q is exact in float32 (an fp16 scale,
  or d times a 6-bit or int8 scale, times an integer of at most 8 bits: at most 24 bits), so the
  FMA the SIMD builds use rounds exactly as the portable multiply-then-add does.
- REORDERED: the products. quant_matmul (the integer path: x quantized per 32 values to int16)
  gets the same int16 values and the same exact int32 dot product per 16 or 32 elements on every
  level; quant_gemm (the batched path: the weights decoded to float32 panels) the same float32
  weights and products. Both then sum float32 partial products in the level's own order (plain
  C: one running sum; AVX2: 8 lanes; AVX-512: 16; R4 / R8: scales premultiplied per 16
  sub-blocks), with FMA or without. So not bit for bit: the reordered float32 sums may move by
  (K/16) * 2^-23 of the largest output (3.8e-6 here, the error of reordering K/16 partial sums
  of the outputs' size; measured up to 7e-7 for both kernels). bfloat16 outputs are those sums
  rounded, so two sides may also land one bfloat16 step (2^-7 of the value) apart.
- INT16_X: where one side took the integer path (x quantized to int16 per 32: each element
  moves by up to half a step, 2^-16 of its 32's largest |x|) and the other a panel GEMM (x as
  it is; where rows_max differs between levels, as for the tiles), an output may also move by
  2^-16 of |W| @ (each x's 32's largest |x|) (2^-14 asserted, as for INT16_GEMM below). Both
  sides on the integer path quantize x alike: REORDERED.
- INT16_GEMM: quant_gemm on an AVX2 build (csrc/quant_gemm_i16.c) quantizes x per 32 values
  to int16 at most 16383 (half a step: 2^-15 of its 32's largest |x|): against any other kind,
  an output may move by 2^-15 of |W| @ (each x's 32's largest |x|) besides the other side's
  rounding (2^-14 asserted in all, for either or both). For the K-quants it takes one scale per
  run of 32s (GEMM_RUNS: Q4_K 256 values, Q5_K 128, Q6_K 64) at most 8191: 2^-14 of each
  x's run's largest |x| (2^-13 asserted).
- BF16_WEIGHTS: quant_gemm with bfloat16 x on a build with AVX512_BF16 decodes the weights to
  bfloat16 panels (vdpbf16ps), where the other builds keep them float32: each weight moves by
  up to 2^-9 of itself, so an output by up to 2^-9 of |x| @ |W| (2^-8 asserted), besides the
  above.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import pytest
import torch

from shardserve.model import kernel_levels
from shardserve.model import native_kernels as nk
from shardserve.model import quant_rows_max as qr
from shardserve.model import quant_types as qt
from shardserve.model import quantization as q
from tests.model.test_quantization import random_blocks

pytestmark = pytest.mark.skipif(not nk.compiler_available(), reason="no C compiler")

EXACT, REORDERED, BF16_WEIGHTS = 0, 1, 2
INT16_X = 3  # the integer path's kind; compared with another path's, adds its x's rounding
INT16_GEMM = 4  # the AVX2 GEMM's: x rounded to int16 at 16383
INT16_KINDS = {INT16_X, INT16_GEMM}
Result = tuple[torch.Tensor, int]  # what an entry point computed, and its kind
N, K = 48, 512  # K: two Q4_K blocks, 16 sub-blocks: every repacked scale group is whole


def gemm_kind(x: torch.Tensor, w: q.QuantWeight) -> int:
    """quant_gemm multiplies int16 x by int16 panels on an AVX2 build (quant_gemm_i16.c),
    bfloat16 x by bfloat16 weight panels (vdpbf16ps) on a build with AVX512_BF16
    (csrc/quant_gemm.c's GEMM_BF16), by float32 panels otherwise."""
    if qr.gemm_int16(w.segments[0][1].ggml_type):
        return INT16_GEMM
    features = set(kernel_levels.isa_features(nk.lib()))
    bf16 = x.dtype == torch.bfloat16 and {"AVX512F", "AVX512BF16"} <= features
    return BF16_WEIGHTS if bf16 else REORDERED


def matmul(w: q.QuantWeight, x: torch.Tensor) -> Result:
    """QuantWeight.matmul as the model calls it: quant_matmul up to rows_max rows of x,
    quant_gemm past them."""
    return w.matmul(x), INT16_X if x.shape[0] <= w.rows_max(x.dtype) else gemm_kind(x, w)


def quant_matmul(w: q.QuantWeight, x: torch.Tensor) -> Result:
    """The integer path itself (csrc/quant_kernels.c), at every row count."""
    out = torch.empty(x.shape[0], N, dtype=x.dtype)
    q.matmul_into(out, x, w.segments[0][1])
    return out, INT16_X


def quant_gemm(w: q.QuantWeight, x: torch.Tensor) -> Result:
    """The batched path itself (csrc/quant_gemm.c), at every row count."""
    out = torch.empty(x.shape[0], N, dtype=x.dtype)
    q.gemm_into(out, x, w.segments[0][1])
    return out, gemm_kind(x, w)


def dequantize_rows(w: q.QuantWeight, x: torch.Tensor) -> Result:
    """The embedding lookup (quant_dequantize_rows): a few rows, repeated and out of order."""
    ids = torch.tensor([N - 1, 0, 7, 7, 30][: x.shape[0] + 1], dtype=torch.int64)
    return q.dequantize_rows(w.segments[0][1], ids, x.dtype), EXACT


# Every kernel entry point compared across levels: name -> run(weight, x) under the current
# build, returning (result, kind). A new entry point is one function and one line here.
ENTRY_POINTS: dict[str, Callable[[q.QuantWeight, torch.Tensor], Result]] = {
    "matmul": matmul,
    "quant_matmul": quant_matmul,
    "quant_gemm": quant_gemm,
    "dequantize_rows": dequantize_rows,
}

WEIGHTS = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 8, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14, "int8": None,
           "Q4_1 (pieces)": 3, "Q8_0 (pieces)": 8, "Q4_K (pieces)": 12, "Q6_K (pieces)": 14}
REPACKED = (qt.R4, qt.R8, qt.T4, qt.T8, qt.T4K, qt.T6K)
GEMM_RUNS = {12: 8, 13: 4, 14: 2}  # the int16 GEMM's 32s per x scale, by ggml type (else 1)
LEVELS = [level for level in nk.levels_buildable_here() if level != "portable"]
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}
REORDER_TOL = (K // 16) * 2.0**-23


@functools.cache
def blocks(name: str) -> q.QuantizedTensor:
    """Random blocks of a GGUF type (random bytes, small finite fp16 scales), or int8."""
    ggml_type = WEIGHTS[name]
    if ggml_type is not None:
        return random_blocks(ggml_type, N, K, seed=ggml_type)
    return q.quantize_int8(torch.randn(N, K, generator=torch.Generator().manual_seed(8)))


def x_rows(rows: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(rows, K, generator=torch.Generator().manual_seed(rows)).to(dtype)


@functools.cache
def abs_products(weight: str, rows: int, dtype: torch.dtype) -> torch.Tensor:
    """|x| @ |W|.T in float64: the scale of a product's rounding errors, output by output."""
    with nk.using(nk.build_level("portable")):
        values = blocks(weight).dequantize(torch.float32)
    return x_rows(rows, dtype).double().abs() @ values.double().abs().T


def weight_as_loaded(name: str) -> q.QuantWeight:
    """The weight as the loader joins it: one piece, or for "(pieces)" pieces of 40 and 8 rows
    (a tile of 16 would straddle them, so the rows stay R4 / R8 / Q4_K)."""
    w = blocks(name)
    pieces = {0: w.narrow_rows(0, 40), 40: w.narrow_rows(40, 8)} if "pieces" in name else {0: w}
    return q.QuantWeight.from_pieces(pieces, N)


@pytest.fixture(scope="module")
def run(level_library):
    """run(level, weight, entry, rows, dtype) -> (result, kind, the weight's ggml type), each
    computed once (the portable side serves every level)."""

    @functools.cache
    def run(level: str, weight: str, entry: str, rows: int, dtype: torch.dtype):
        with nk.using(level_library(level)):
            w = weight_as_loaded(weight)  # repacked where the level does
            got, kind = ENTRY_POINTS[entry](w, x_rows(rows, dtype))
        return got, kind, w.segments[0][1].ggml_type

    return run


@functools.cache
def x_rounding(weight: str, rows: int, dtype: torch.dtype, gemm: bool) -> torch.Tensor:
    """2^-14 of |W| @ (each x's 32's largest |x|): what x's int16 roundings may move an output;
    where the int16 GEMM took a K-quant (`gemm`), 2^-13 of |W| @ (each x's run's largest |x|)."""
    with nk.using(nk.build_level("portable")):
        values = blocks(weight).dequantize(torch.float32)
    run = GEMM_RUNS.get(WEIGHTS[weight], 1) if gemm else 1
    x = x_rows(rows, dtype).double().abs().reshape(rows, K // (32 * run), 32 * run)
    scale = 2.0**-14 if run == 1 else 2.0**-13
    return scale * (x.amax(-1).repeat_interleave(32 * run, -1) @ values.double().abs().T)


def assert_agrees(got: torch.Tensor, want: torch.Tensor, kind: int, abs_prod: torch.Tensor | None,
                  x_round: torch.Tensor | None = None) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype
    if kind == EXACT:
        assert torch.equal(got, want)
        return
    g, w = got.double(), want.double()
    diff, scale = (g - w).abs(), w.abs().max()
    limit = REORDER_TOL * scale + (w.abs() * 2.0**-7 if got.dtype == torch.bfloat16 else 0)
    if kind == BF16_WEIGHTS:
        limit = limit + 2.0**-8 * abs_prod
    if x_round is not None:
        limit = limit + x_round
    assert (diff <= limit).all(), (diff / scale).max()


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("rows", [1, 5, 11])
@pytest.mark.parametrize("entry", ENTRY_POINTS)
@pytest.mark.parametrize("weight", WEIGHTS)
@pytest.mark.parametrize("level", LEVELS)
def test_every_level_agrees_with_the_portable_build(run, level, weight, entry, rows, dtype):
    got, kind, _ = run(level, weight, entry, rows, dtype)
    want, want_kind, portable_type = run("portable", weight, entry, rows, dtype)
    assert portable_type == (WEIGHTS[weight] or qt.Q8_0)  # the portable build never repacks
    prods = abs_products(weight, rows, dtype) if entry != "dequantize_rows" else None
    kinds = {kind, want_kind} - INT16_KINDS
    mixed = kind != want_kind and {kind, want_kind} & INT16_KINDS  # x rounded on one side only
    # (or to other steps)
    assert_agrees(got, want, max(kinds) if kinds else REORDERED, prods,
                  x_rounding(weight, rows, dtype, INT16_GEMM in {kind, want_kind}) if mixed
                  else None)


@pytest.mark.parametrize("level", nk.levels_buildable_here())
def test_a_level_repacks_exactly_where_its_kernels_take_them(run, level_library, level):
    """So the comparisons above cover every repacked layout wherever a level has it (AVX-512
    every one; AVX2 levels Q4_0 / Q4_1's T4, Q8_0's T8, Q4_K's T4K and Q6_K's T6K)."""
    lib = level_library(level)
    features = set(kernel_levels.isa_features(lib))
    assert bool(lib.quant_can_repack()) == ({"AVX512BW", "AVX512VL", "F16C"} <= features)
    assert bool(lib.quant_can_tile()) == bool(lib.quant_can_repack())
    avx2 = not lib.quant_can_tile() and {"AVX2", "FMA", "F16C"} <= features
    types = {name: run(level, name, "matmul", 1, torch.float32)[2] for name in WEIGHTS}
    tiles = {"Q4_0": qt.T4, "Q4_1": qt.T4, "Q8_0": qt.T8, "int8": qt.T8, "Q4_K": qt.T4K,
             "Q6_K": qt.T6K}
    rows = {"Q4_1 (pieces)": qt.R4, "Q8_0 (pieces)": qt.R8}
    want = (tiles if lib.quant_can_tile() or avx2 else {}) \
        | (rows if lib.quant_can_repack() else {})
    repacked = {name: t for name, t in types.items() if t in REPACKED}
    assert repacked == want


@pytest.mark.parametrize("level", LEVELS)
def test_repacked_rows_on_the_portable_build_equal_their_blocks(level_library, level):
    """Repacked bytes hold the same values as their blocks: the portable build (which
    decodes them in plain C) computes them bit for bit as the original blocks."""
    lib = level_library(level)
    if not lib.quant_tile_takes(qt.Q4_1):  # AVX-512 and AVX2 levels tile every tiled type
        pytest.skip(f"{level} does not repack")
    pieces = ("Q4_1 (pieces)", "Q8_0 (pieces)") if lib.quant_can_repack() else ()
    names = ("Q4_0", "Q4_1", "Q8_0", "int8", "Q4_K", "Q6_K", *pieces)
    for name in names:
        with nk.using(level_library(level)):
            packed = weight_as_loaded(name)
        with nk.using(level_library("portable")):
            plain = weight_as_loaded(name)
            assert packed.segments[0][1].ggml_type in REPACKED
            assert torch.equal(packed.dequantize(torch.float32), plain.dequantize(torch.float32))
            for rows in (1, 3, 5, 40):  # 40: the GEMM, its panels decoded from the tiles
                x = x_rows(rows, torch.float32)
                assert torch.equal(packed.matmul(x), plain.matmul(x)), (name, rows)


# ---- the levels themselves ----------------------------------------------------------------

# kernel_isa()'s names -> the /proc/cpuinfo flag of the same instruction set.
CPU_FLAG = {"AVX2": "avx2", "FMA": "fma", "F16C": "f16c", "AVX512F": "avx512f",
            "AVX512BW": "avx512bw", "AVX512VL": "avx512vl", "AVX512VNNI": "avx512_vnni",
            "AVX512BF16": "avx512_bf16", "AMX-BF16": "amx_bf16"}


def test_levels_buildable_here_follow_the_cpu(monkeypatch):
    flags = kernel_levels.cpu_flags()
    has_avx2 = kernel_levels.X86 and {"avx2", "fma", "f16c"} <= flags
    assert nk.levels_buildable_here() == ["native", *(["avx2"] if has_avx2 else []), "portable"]
    monkeypatch.setattr(kernel_levels, "X86", True)
    monkeypatch.setattr(kernel_levels, "cpu_flags", lambda: {"sse4_2", "avx", "fma"})
    assert nk.levels_buildable_here() == ["native", "portable"]
    with pytest.raises(ValueError, match=r"'avx2' cannot run here: this CPU lacks avx2, f16c.*"
                                         r"runs: native, portable \(SHARDSERVE_ISA\)"):
        nk.build_level("avx2")
    with pytest.raises(ValueError, match=r"unknown ISA level 'avx512': choose one of native, "
                                         r"avx2, portable"):
        nk.build_level("avx512")


def test_the_isa_knob_names_a_bad_value_and_the_choices(monkeypatch, native_kernels_on):
    from shardserve import envs

    monkeypatch.delenv("SHARDSERVE_ISA", raising=False)
    assert envs.isa() == "native"
    monkeypatch.setenv("SHARDSERVE_ISA", " AVX2 ")
    assert envs.isa() == "avx2"
    monkeypatch.setenv("SHARDSERVE_ISA", "sse4")
    with pytest.raises(ValueError, match=r"SHARDSERVE_ISA='sse4' .*native, avx2, portable"):
        nk.library()  # refused, not a fallback to PyTorch: a setting to fix
    monkeypatch.setenv("SHARDSERVE_ISA", "avx2")
    monkeypatch.setattr(kernel_levels, "cpu_flags", lambda: set())
    with pytest.raises(ValueError, match="'avx2' cannot run here"):
        nk.library()


@pytest.mark.parametrize("level", nk.levels_buildable_here())
def test_library_loads_the_chosen_level_and_logs_what_it_runs(
    monkeypatch, caplog, native_kernels_on, level
):
    monkeypatch.setenv("SHARDSERVE_ISA", level)
    with caplog.at_level(logging.INFO, logger="shardserve.model.native_kernels"):
        lib = nk.library()
    assert lib is not None and lib.arch_flags == kernel_levels.ARCH_FLAGS[level]
    features = kernel_levels.isa_features(lib)
    cpu = {name for name, flag in CPU_FLAG.items() if flag in kernel_levels.cpu_flags()}
    want = {"native": cpu, "avx2": {"AVX2", "FMA", "F16C"}, "portable": set()}[level]
    if kernel_levels.X86:
        assert set(features) == want
    report = nk.isa_report(lib)
    assert report.startswith(f"level {level} ({' '.join(lib.arch_flags) or 'no -march'}; ")
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert infos == [f"native CPU kernels: {report}"]


def test_a_report_names_the_instruction_sets():
    assert kernel_levels.describe(list(kernel_levels.ISA_BITS)) == \
        "AVX2, FMA, F16C, AVX-512 F/BW/VL, VNNI, BF16, AMX-BF16"
    assert kernel_levels.describe(["AVX2", "FMA", "F16C"]) == "AVX2, FMA, F16C"
    assert kernel_levels.describe([]) == "plain C (no AVX2)"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("level", nk.levels_buildable_here())
def test_every_level_silu_mul_agrees_with_torch(level_library, level, dtype):
    """The SwiGLU activation on each level (cpu_kernels.c: the portable expf, AVX2's exp8,
    AVX-512's exp16) within float32 rounding of torch's (bfloat16: its rounding of silu, then
    of the product, as HF's bf16 ops round), the exps' clamps and both vector widths' tails
    (1544 = 96 x 16 + 8) included."""
    gen = torch.Generator().manual_seed(3)
    gate_up = 4 * torch.randn(3, 2 * 1544, generator=gen)
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])
    gate_up = gate_up.to(dtype)
    gate, up = gate_up.split(1544, dim=-1)
    with nk.using(level_library(level)):
        got = nk.silu_mul(gate_up)
    tol = dict(rtol=2e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=8e-3, atol=1e-5)
    torch.testing.assert_close(got, torch.nn.functional.silu(gate) * up, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("level", nk.levels_buildable_here())
def test_every_level_rms_norm_agrees_with_torch(level_library, level, dtype):
    """RMSNorm with the residual add on each level (the portable row, AVX2's and AVX-512's
    lanes: 576 = 36 x 16, and 40 = 5 x 8, which AVX-512 leaves to the portable row), within
    the rounding of HF's float32 steps; the residual is written back rounded to dtype."""
    gen = torch.Generator().manual_seed(4)
    for hidden in (576, 40):
        x = torch.randn(3, hidden, generator=gen).to(dtype)
        residual = torch.randn(3, hidden, generator=gen).to(dtype)
        weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype)
        summed = (x.float() + residual.float()).to(dtype)
        v = summed.float()
        normed = (v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
        expected = weight * normed
        res = residual.clone()
        with nk.using(level_library(level)):
            got = nk.rms_norm(x, weight, 1e-5, res)
        tol = dict(rtol=2e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=8e-3, atol=1e-5)
        torch.testing.assert_close(res, summed, rtol=0, atol=0)
        torch.testing.assert_close(got, expected, **tol)
