"""The quantized-weight kernels (csrc/quant_kernels.c) against the gguf package's own
dequantization, on random blocks of every kept GGUF type.

Oracle: `gguf.quants.dequantize` (numpy, llama.cpp's reference written again in Python), then a
float64 matmul. What each path must meet:
- the embedding lookup (`dequantize_rows`) equals the gguf values bit for bit;
- the integer path (up to quant_rows_max.rows_max rows of x) quantizes x per 32 values to int16,
  so it is compared with the reference on an x that int16 represents exactly (each block an
  integer vector times a power of two, holding +-32767): there it must agree to float32
  rounding (relative 1e-5 of the largest output); on a random x the activation rounding adds
  ~1e-5 (1e-4 asserted; bfloat16 inputs and outputs 1e-2);
- past rows_max rows, the panel GEMM (csrc/quant_gemm.c: weights decoded to float32,
  x not quantized): float32 agrees to 1e-5, bfloat16 (x and the output rounded) to 1e-2; on
  AVX2 builds its int16 panels (csrc/quant_gemm_i16.c: x quantized per 32 to at most 16383,
  twice the integer path's step; for the K-quants per 64-256 values to at most 8191) to 3e-4.
Each is run on the native build and on the AVX2 (x86-64-v3) and portable (x86-64-v2) builds.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from shardserve.model import native_kernels as nk
from shardserve.model import quant_rows_max as qr
from shardserve.model import quant_types as qt
from shardserve.model import quantization as q
from shardserve.model.huge_pages import huge_pages_on

pytestmark = pytest.mark.skipif(not nk.compiler_available(), reason="no C compiler")

# Byte offsets of each type's fp16 scale fields inside a block (random bytes there could be
# inf/NaN; the rest of a block is any bytes at all).
_HALF_FIELDS = {2: [0], 3: [0, 2], 8: [0], 12: [0, 2], 13: [0, 2], 14: [208]}
TYPES = sorted(qt.GGML_TYPES)
ARCHES = {"native": nk.NATIVE_ARCH, "avx2": ("-march=x86-64-v3",), "portable": nk.PORTABLE_ARCH}


def random_blocks(ggml_type: int, rows: int, cols: int, seed: int) -> q.QuantizedTensor:
    rng = np.random.default_rng(seed)
    _, elems, nbytes = qt.GGML_TYPES[ggml_type]
    data = rng.integers(0, 256, size=(rows, cols // elems, nbytes), dtype=np.uint8)
    for off in _HALF_FIELDS[ggml_type]:
        halves = (rng.standard_normal((rows, cols // elems)) * 0.01).astype(np.float16)
        data[:, :, off : off + 2] = halves.view(np.uint8).reshape(rows, cols // elems, 2)
    return q.QuantizedTensor(torch.from_numpy(data.reshape(rows, -1).copy()), ggml_type, cols)


def reference(w: q.QuantizedTensor) -> torch.Tensor:
    values = dequantize(w.data.numpy(), GGMLQuantizationType(w.ggml_type))
    return torch.from_numpy(values.astype(np.float32)).reshape(w.shape)


def int16_exact_x(rows: int, cols: int, seed: int) -> torch.Tensor:
    """x whose per-32 int16 quantization is exact: integers in [-32767, 32767] (one of them
    +-32767 per block) times a power of two per block."""
    g = torch.Generator().manual_seed(seed)
    ints = torch.randint(-32767, 32768, (rows, cols // 32, 32), generator=g)
    ints[:, :, 0] = 32767 * (1 - 2 * torch.randint(0, 2, (rows, cols // 32), generator=g))
    scale = 2.0 ** torch.randint(-20, -12, (rows, cols // 32, 1), generator=g).float()
    return (ints.float() * scale).reshape(rows, cols)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).abs().max() / want.double().abs().max()).item()


@pytest.fixture(scope="module", params=list(ARCHES))
def kernels(request):
    with nk.using(nk.build_library(ARCHES[request.param])):
        yield request.param


@pytest.mark.parametrize("ggml_type", TYPES, ids=[qt.GGML_TYPES[t][0] for t in TYPES])
def test_dequantized_rows_equal_the_gguf_package(kernels, ggml_type):
    w = random_blocks(ggml_type, 40, 512, seed=ggml_type)
    ref = reference(w)
    assert torch.equal(w.dequantize(torch.float32), ref)
    ids = torch.tensor([39, 0, 7, 7], dtype=torch.int64)
    assert torch.equal(q.dequantize_rows(w, ids, torch.float32), ref[ids])
    assert torch.equal(q.dequantize_rows(w, ids, torch.bfloat16), ref[ids].bfloat16())


@pytest.mark.parametrize("ggml_type", TYPES, ids=[qt.GGML_TYPES[t][0] for t in TYPES])
@pytest.mark.parametrize("rows", [1, 2, 3])
def test_integer_path_is_exact_where_int16_holds_x(kernels, ggml_type, rows):
    w = random_blocks(ggml_type, 72, 512, seed=ggml_type + rows)
    x = int16_exact_x(rows, 512, seed=rows)
    got = q.QuantWeight.from_pieces({0: w}, 72).matmul(x)
    assert rel_err(got, x.double() @ reference(w).double().T) < 1e-5


@pytest.mark.parametrize("ggml_type", [2, 3, 8], ids=["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("cols", [32, 96, 288, 576, 2080])  # blocks past groups of 8: 1 3 1 2 1
def test_integer_path_every_row_count_and_row_tail(kernels, ggml_type, cols):
    """The AVX2 rows sum blocks in groups of 8 and the rest one by one; 1-8 rows of x each take
    a kernel of their own (9 rows: a pass of 8 and one of 1); one row of x takes strips of 8
    weight rows below K = 2048 (27 rows: tiles of 16 and 11, so strips and 3 single rows)."""
    w = random_blocks(ggml_type, 27, cols, seed=cols + ggml_type)
    want_w = reference(w).double()
    for rows in range(1, 10):
        x = int16_exact_x(rows, cols, seed=rows)
        out = torch.empty(rows, 27)
        q.matmul_into(out, x, w)
        assert rel_err(out, x.double() @ want_w.T) < 1e-5, rows


@pytest.mark.parametrize("ggml_type", TYPES, ids=[qt.GGML_TYPES[t][0] for t in TYPES])
@pytest.mark.parametrize("rows", [1, 3, 6, 9, 24, 33])  # either side of every rows_max
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_random_x_within_the_activation_rounding(kernels, ggml_type, rows, dtype):
    w = random_blocks(ggml_type, 48, 512, seed=100 + ggml_type)
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows)).to(dtype)
    weight = q.QuantWeight.from_pieces({0: w}, 48)
    got = weight.matmul(x)
    assert got.dtype == dtype and got.shape == (rows, 48)
    want = x.double() @ reference(w).double().T
    gemm = rows > weight.rows_max(dtype)  # float32 panels, or int16 ones on AVX2 builds
    # x rounded at 16383: twice the rows' step (the type as loaded: a tile's own rows_max)
    int16_gemm = gemm and qr.gemm_int16(weight.segments[0][1].ggml_type)
    limit = 1e-2 if dtype == torch.bfloat16 else 3e-4 if int16_gemm else 1e-5 if gemm else 1e-4
    assert rel_err(got, want) < limit


def test_segments_of_different_types_fill_their_columns(kernels):
    """A fused q/k/v whose pieces hold different types (Q4_K_M files do) and a float32 output
    of bfloat16 input (the LM head's logits)."""
    a, b = random_blocks(12, 64, 512, seed=1), random_blocks(14, 32, 512, seed=2)
    weight = q.QuantWeight.from_pieces({64: b, 0: a}, 96)
    assert [off for off, _ in weight.segments] == [0, 64]
    x = int16_exact_x(2, 512, seed=3)
    want = x.double() @ torch.cat([reference(a), reference(b)]).double().T
    assert rel_err(weight.matmul(x), want) < 1e-5
    logits = weight.matmul(x.bfloat16(), out_dtype=torch.float32)
    assert logits.dtype == torch.float32 and rel_err(logits, want) < 1e-2


@pytest.mark.parametrize("ggml_type", [3, 12, 14], ids=["Q4_1", "Q4_K", "Q6_K"])
def test_gemm_edges_long_rows_and_strided_x(kernels, ggml_type):
    """The panel GEMM where its tiling has edges: K past one panel chunk (4,096) and not a
    multiple of it, N not a multiple of a tile, B not a multiple of the row group, x a column
    range of a wider tensor (row stride != K), the output a column range of a wider one."""
    w = random_blocks(ggml_type, 53, 4608, seed=7)
    wide = torch.randn(23, 4608 + 64, generator=torch.Generator().manual_seed(8))
    x = wide[:, 32:32 + 4608]
    out = torch.full((23, 70), 7.0)
    q.gemm_into(out.narrow(1, 9, 53), x, w)
    want = x.double() @ reference(w).double().T
    assert rel_err(out[:, 9:62], want) < (3e-4 if qr.gemm_int16(ggml_type) else 1e-5)
    assert (out[:, :9] == 7).all() and (out[:, 62:] == 7).all()  # nothing written beside it


def extreme_blocks(ggml_type: int, rows: int, cols: int) -> q.QuantizedTensor:
    """K-quant blocks whose every value is the type's largest in magnitude: Q4_K / Q5_K every
    6-bit scale 63 and q 15 / 31 (mins 0), Q6_K every scale -128 and q -32; d = 2^-10."""
    _, elems, nbytes = qt.GGML_TYPES[ggml_type]
    data = np.full((rows, cols // elems, nbytes), 0xFF, dtype=np.uint8)
    half = np.array([2.0**-10], dtype=np.float16).view(np.uint8)
    if ggml_type == qt.Q6_K:
        data[:, :, :192] = 0  # ql, qh: q = -32
        data[:, :, 192:208] = 0x80  # scales: -128
        data[:, :, 208:210] = half
    else:
        data[:, :, 0:2] = half
        data[:, :, 2:4] = 0  # dmin
    return q.QuantizedTensor(torch.from_numpy(data.reshape(rows, -1).copy()), ggml_type, cols)


@pytest.mark.parametrize("ggml_type", [12, 13, 14], ids=["Q4_K", "Q5_K", "Q6_K"])
def test_gemm_int32_sums_hold_the_largest_products(kernels, ggml_type):
    """The int16 GEMM sums a run of 64-256 products in one int32 (csrc/quant_gemm_i16.c): with
    every weight and every x at its largest, of one sign, no sum overflows (a run one step
    longer would). Also through the tiles a build makes of them (T4K)."""
    w = extreme_blocks(ggml_type, 32, 1024)
    for x in (torch.ones(20, 1024), -torch.ones(20, 1024)):
        for weight in (w, q.repack(w)):
            out = torch.empty(20, 32)
            q.gemm_into(out, x, weight)
            assert rel_err(out, x.double() @ reference(w).double().T) < 1e-4, weight.ggml_type


def test_same_type_pieces_merge_into_one_segment():
    a, b = random_blocks(3, 8, 64, seed=1), random_blocks(3, 4, 64, seed=2)
    weight = q.QuantWeight.from_pieces({0: a, 8: b}, 12)
    assert len(weight.segments) == 1
    assert torch.equal(weight.dequantize(torch.float32),
                       torch.cat([reference(a), reference(b)]))


def test_column_split_keeps_whole_blocks_and_refuses_to_cut_one():
    w = random_blocks(12, 8, 1024, seed=5)  # Q4_K: 256 columns a block
    assert torch.equal(w.narrow_cols(256, 512).dequantize(), reference(w)[:, 256:768])
    assert torch.equal(w.narrow_rows(2, 3).dequantize(), reference(w)[2:5])
    with pytest.raises(ValueError, match=r"Q4_K .*cannot be split.*multiples of 256"):
        w.narrow_cols(0, 384)


def test_int8_per_channel_quantization():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(24, 96, generator=g) * torch.linspace(0.01, 2, 24).unsqueeze(1)
    qt = q.quantize_int8(w)
    assert qt is not None and qt.type_name == "Q8_0"
    deq = qt.dequantize()
    step = (w.abs().amax(dim=1, keepdim=True) / 127)
    assert ((deq - w).abs() <= step * 0.51 + 1e-6).all()  # half a step (fp16 scale rounding)
    # one scale per row: every block of a row holds the same fp16 scale
    scales = qt.data.view(24, 3, 34)[:, :, :2]
    assert (scales == scales[:, :1]).all()
    x = int16_exact_x(2, 96, seed=1)
    got = q.QuantWeight.from_pieces({0: qt}, 24).matmul(x)
    assert rel_err(got, x.double() @ deq.double().T) < 1e-5
    assert q.quantize_int8(torch.randn(4, 40)) is None  # 40 columns: not whole blocks


@pytest.mark.skipif(not huge_pages_on(), reason="no transparent huge pages here")
def test_streamed_pieces_are_copied_into_huge_pages_and_join_by_type():
    """With huge pages on, every streamed piece is a copy in huge-page memory (file_map), so
    pieces of one type join even where they lie apart; a lookup-only weight (repack=False) keeps
    its views."""
    q_, k, v = (random_blocks(t, n, 256, seed=n) for t, n in ((12, 8), (12, 4), (14, 5)))
    w = q.QuantWeight.from_pieces({0: q_, 8: k, 12: v}, 17, join_apart=False)
    assert [off for off, _ in w.segments] == [0, 12]
    sources = {t.data.data_ptr() for t in (q_, k, v)}
    assert not sources & {seg.data.data_ptr() for _, seg in w.segments}
    assert torch.equal(w.dequantize(torch.float32),
                       torch.cat([reference(q_), reference(k), reference(v)]))
    kept = q.QuantWeight.from_pieces({0: q_}, 8, repack=False)
    assert kept.segments[0][1].data.data_ptr() == q_.data.data_ptr()


def test_mixed_type_pieces_stay_apart_unless_back_to_back(monkeypatch):
    """With huge pages off: a Q4_K_M-style q/k/v (q, k Q4_K; v Q6_K): joining q and k would
    copy them and still leave two segments, so they stay as they are; rows back to back in one
    tensor join by a view; pieces of one type apart join by a copy unless join_apart=False."""
    monkeypatch.setenv("SHARDSERVE_HUGE_PAGES", "0")
    q_, k, v = (random_blocks(t, n, 256, seed=n) for t, n in ((12, 8), (12, 4), (14, 5)))
    want = torch.cat([reference(q_), reference(k), reference(v)])
    apart = q.QuantWeight.from_pieces({0: q_, 8: k, 12: v}, 17)
    assert [off for off, _ in apart.segments] == [0, 8, 12]
    assert [seg.data.data_ptr() for _, seg in apart.segments] == \
        [t.data.data_ptr() for t in (q_, k, v)]  # no copies
    qk = random_blocks(12, 12, 256, seed=3)
    joined = q.QuantWeight.from_pieces({0: qk.narrow_rows(0, 8), 8: qk.narrow_rows(8, 4),
                                        12: v}, 17)
    assert [off for off, _ in joined.segments] == [0, 12]
    assert joined.segments[0][1].data.data_ptr() == qk.data.data_ptr()
    # One type but apart: copied into one segment unless the model declines (join_apart).
    assert len(q.QuantWeight.from_pieces({0: q_, 8: k}, 12).segments) == 1
    kept = q.QuantWeight.from_pieces({0: q_, 8: k}, 12, join_apart=False)
    assert [seg.data.data_ptr() for _, seg in kept.segments] == \
        [t.data.data_ptr() for t in (q_, k)]
    assert torch.equal(apart.dequantize(torch.float32), want)
    assert torch.equal(joined.dequantize(torch.float32),
                       torch.cat([reference(qk), reference(v)]))
