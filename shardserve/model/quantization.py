"""Weights kept quantized: a GGUF file's blocks as stored (`quantization="gguf"`) or int8 per
output channel (`quantization="int8"`), and the matrix products computed from them by
csrc/quant_kernels.c (its header explains the scheme and the block layouts).

A `QuantizedTensor` is a [rows, cols] matrix as GGML blocks: `data` is uint8 [rows, row_bytes],
a row being whole blocks. Rows are independent, so tensor parallelism's output split and the
Q/K row permutations move whole byte rows; an input split moves whole blocks and is
refused where it would cut one. int8 weights use the Q8_0 layout (32 int8 and an fp16 scale
per block) with one scale per row, so one kernel serves both. The block types are
quant_types.py's; which kernel a product takes by its rows of x, quant_rows_max.py's.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise

import torch

from shardserve import envs
from shardserve.model import native_kernels, quant_repack
from shardserve.model.file_map import drop_pages
from shardserve.model.huge_pages import huge_pages_on, weight_memory
from shardserve.model.quant_rows_max import ROWS_MAX_BF16, rows_max
from shardserve.model.quant_types import (
    GGML_TYPES,
    Q4_1,
    Q4_K,
    Q6_K,
    Q8_0,
    R4,
    R8,
    REPACKED,
    TILE_OF,
    TILED,
    layout,
)

_OUT_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_ERRORS = {-1: "out of memory for its scratch buffers", -2: "a type or row length it cannot take"}


@dataclass(frozen=True)
class QuantizedTensor:
    data: torch.Tensor  # uint8 [rows, row_bytes], contiguous
    ggml_type: int
    cols: int
    source_type: int | None = None  # the GGUF type a repacked (R4 / R8) tensor came from
    # Q/K rows already in the model's interleaved RoPE order per head (llama.cpp's own order,
    # kept by the GGUF loader) rather than HF's rotate-half order.
    rope_interleaved: bool = False

    def __post_init__(self) -> None:
        name, elems, nbytes = layout(self.ggml_type)
        if self.cols % elems or self.data.shape[-1] != self.cols // elems * nbytes:
            raise ValueError(f"{name}: {self.data.shape[-1]} bytes per row do not hold "
                             f"{self.cols} elements")

    @property
    def shape(self) -> tuple[int, int]:
        return (self.data.shape[0], self.cols)

    @property
    def type_name(self) -> str:
        """The GGUF type the values came in (a repacked tensor keeps its source's name)."""
        return GGML_TYPES[self.source_type or self.ggml_type][0]

    def narrow_rows(self, start: int, length: int) -> QuantizedTensor:
        if self.ggml_type in TILED and (start % 16 or length % 16):
            raise ValueError(f"a tiled weight's rows come in tiles of 16: [{start}, "
                             f"{start + length}) cuts one")
        return QuantizedTensor(self.data.narrow(0, start, length).contiguous(), self.ggml_type,
                               self.cols, self.source_type)

    def index_rows(self, rows: torch.Tensor) -> QuantizedTensor:
        if self.ggml_type in TILED:
            raise ValueError("a tiled weight's rows lie in tiles: pick rows before repacking")
        return QuantizedTensor(self.data.index_select(0, rows), self.ggml_type, self.cols,
                               self.source_type)

    def narrow_cols(self, start: int, length: int) -> QuantizedTensor:
        """Columns [start, start + length): whole blocks only (a tensor-parallel input split)."""
        if self.ggml_type in REPACKED:
            raise ValueError("a repacked weight is split before it is repacked, not after")
        _, elems, nbytes = GGML_TYPES[self.ggml_type]
        if start % elems or length % elems:
            raise ValueError(
                f"a {self.type_name} weight with {self.cols} input columns cannot be split at "
                f"columns [{start}, {start + length}): its blocks hold {elems} columns and a "
                f"shard may not cut one; choose a tensor-parallel size whose input shards are "
                f"multiples of {elems}, or load with quantization='none'"
            )
        data = self.data.narrow(1, start // elems * nbytes, length // elems * nbytes)
        return QuantizedTensor(data.contiguous(), self.ggml_type, length)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        ids = torch.arange(self.data.shape[0])
        return dequantize_rows(self, ids, dtype)


def is_kept_type(ggml_type: int) -> bool:
    """Whether tensors of this ggml type can stay quantized."""
    return ggml_type in GGML_TYPES


def available() -> bool:
    """Whether the quantized kernels can run here (the native library builds and loads)."""
    return native_kernels.supports(torch.float32, torch.device("cpu"))


def repacked_type(w: QuantizedTensor, tiled: bool = True) -> int | None:
    """T4 for Q4_0 / Q4_1, T8 for Q8_0, T4K for Q4_K and T6K for Q6_K where `tiled` (the
    caller's pieces) and w's rows come in multiples of 16 and this build computes that tile
    (AVX-512 and AVX2 every one; SHARDSERVE_TILES=0: none); else R4 (cols a
    multiple of 64) and R8 where it computes those (AVX-512; the K-quants keep their layout);
    None to keep w's layout."""
    if w.ggml_type not in TILE_OF:
        return None
    lib = native_kernels.lib()
    if tiled and w.shape[0] % 16 == 0 and lib.quant_tile_takes(w.ggml_type) and envs.tiles():
        return TILE_OF[w.ggml_type]
    if w.ggml_type in (Q4_K, Q6_K) or (w.ggml_type != Q8_0 and w.cols % 64) or \
            not lib.quant_can_repack():
        return None
    return R8 if w.ggml_type == Q8_0 else R4


def _row_bytes(kind: int, cols: int) -> int:
    _, elems, nbytes = REPACKED[kind]
    return cols // elems * nbytes


def repack_into(w: QuantizedTensor, dst: torch.Tensor, kind: int) -> None:
    """w's rows in layout `kind` (its repacked_type) into dst uint8 [rows, row_bytes]. Exact."""
    if kind in TILED:
        quant_repack.repack_tiles(w.data, dst, w.cols, w.ggml_type)
    elif w.ggml_type == Q8_0:
        quant_repack.repack_r8(w.data, dst, w.cols)
    else:
        quant_repack.repack_r4(w.data, dst, w.cols, has_min=w.ggml_type == Q4_1)


def repack(w: QuantizedTensor) -> QuantizedTensor:
    """w as repacked_type says (a tile or R4 / R8), else unchanged. Exact: same values."""
    kind = repacked_type(w)
    if kind is None:
        return w
    data = weight_memory(w.shape[0], _row_bytes(kind, w.cols))
    repack_into(w, data, kind)
    return QuantizedTensor(data, kind, w.cols, w.ggml_type)


def quantize_int8(weight: torch.Tensor) -> QuantizedTensor | None:
    """Per-output-channel int8 of a [rows, cols] float weight (one fp16 scale per row, stored as
    Q8_0 blocks); None where cols is not a multiple of 32 or a scale overflows fp16."""
    rows, cols = weight.shape
    if cols % 32:
        return None
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1, keepdim=True) / 127.0).half()
    if not torch.isfinite(scale).all():
        return None
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(w / scale.float()).clamp_(-127, 127).to(torch.int8)
    blocks = q.view(rows, cols // 32, 32).view(torch.uint8)
    scales = scale.view(torch.uint8).view(rows, 1, 2).expand(rows, cols // 32, 2)
    data = torch.cat([scales, blocks], dim=2).reshape(rows, cols // 32 * 34)
    return QuantizedTensor(data.contiguous(), Q8_0, cols)


def _threads() -> int:
    return torch.get_num_threads()


def _check(rc: int, what: str) -> None:
    if rc:
        raise RuntimeError(f"{what}: {_ERRORS.get(rc, f'error {rc}')}")


def matmul_into(out: torch.Tensor, x: torch.Tensor, w: QuantizedTensor) -> None:
    """out[:, :] = x @ W.T for x [B, K] (float32 or bfloat16, unit column stride) and a
    quantized W [N, K]; out is a [B, N] view with unit column stride (a column range of a
    wider output is fine). The integer kernel: x quantized to int16, for 1-3 rows."""
    _product("quant_matmul", out, x, w)


def gemm_into(out: torch.Tensor, x: torch.Tensor, w: QuantizedTensor) -> None:
    """out = x @ W.T as matmul_into, for many rows of x: the weight decoded panel by panel to
    float32 and reused by every row (csrc/quant_gemm.c), no dense copy kept."""
    _product("quant_gemm", out, x, w)


def _product(kernel: str, out: torch.Tensor, x: torch.Tensor, w: QuantizedTensor) -> None:
    b, k = x.shape
    if k != w.cols or out.shape != (b, w.shape[0]) or x.stride(1) != 1 or out.stride(1) != 1:
        raise ValueError(f"{kernel} shapes: x {tuple(x.shape)}, W {w.shape}, "
                         f"out {tuple(out.shape)}")
    rc = getattr(native_kernels.lib(), kernel)(
        out.data_ptr(), out.stride(0), _OUT_DTYPES[out.dtype], x.data_ptr(), x.stride(0),
        _OUT_DTYPES[x.dtype], w.data.data_ptr(), w.data.stride(0), w.ggml_type, b,
        w.shape[0], k, _threads(),
    )
    _check(rc, f"{kernel} ({w.type_name})")


def dequantize_rows(w: QuantizedTensor, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows `ids` (int64) of W as `dtype` [len(ids), cols]: the embedding lookup of a quantized
    table. float32 results equal the gguf package's dequantization."""
    ids = ids.contiguous()
    if ids.dtype != torch.int64:
        raise ValueError(f"ids must be int64, got {ids.dtype}")
    out_dtype = dtype if dtype in _OUT_DTYPES else torch.float32
    out = torch.empty(ids.numel(), w.cols, dtype=out_dtype)
    rc = native_kernels.lib().quant_dequantize_rows(
        out.data_ptr(), _OUT_DTYPES[out_dtype], w.data.data_ptr(), w.data.stride(0),
        w.ggml_type, ids.data_ptr(), ids.numel(), w.cols, _threads(),
    )
    _check(rc, f"quant_dequantize_rows ({w.type_name})")
    return out if out_dtype == dtype else out.to(dtype)


@dataclass(frozen=True)
class QuantWeight:
    """A layer's weight as quantized row ranges (a fused q/k/v may hold a different type per
    piece, as Q4_K_M files do): (first output row, QuantizedTensor) in row order, covering all
    `rows` output rows."""

    segments: tuple[tuple[int, QuantizedTensor], ...]
    rows: int
    cols: int

    @classmethod
    def from_pieces(cls, pieces: dict[int, QuantizedTensor], rows: int,
                    join_apart: bool = True, repack: bool = True) -> QuantWeight:
        """Pieces (first row -> rows) as segments, repacked where that computes faster.

        Pieces of one type that follow each other join into one segment where they lie back to
        back in memory (a view, no copy) or, with `join_apart`, by a copy where the whole
        weight is then one segment: the fused decode takes only that (the model asks for it
        where every layer can be one segment). Otherwise they stay apart, views of the file:
        a weight of several types (Q4_K_M's q/k/v) would be several segments anyway, and
        a second segment costs ~1-5% of that product at batch 1 (one more kernel call).
        Pieces written into tiles or into huge pages (_segment) are copies anyway: those of one
        type always join.
        """
        order = sorted(pieces.items())
        one_type = len({p.ggml_type for _, p in order}) == 1
        groups: list[list[tuple[int, QuantizedTensor]]] = []
        for offset, piece in order:
            last = groups[-1][-1] if groups else None
            copied = repack and last is not None and last[1].ggml_type == piece.ggml_type and \
                (huge_pages_on() or repacked_type(piece) in TILED)
            if last is not None and last[0] + last[1].shape[0] == offset and \
                    ((one_type and join_apart) or copied or _back_to_back(last[1], piece)):
                groups[-1].append((offset, piece))
            else:
                groups.append([(offset, piece)])
        segments = tuple((group[0][0], _segment([p for _, p in group], repack))
                         for group in groups)
        return cls(segments, rows, order[0][1].cols)

    def __post_init__(self) -> None:
        # The batch-1 decode step calls a weight ~120 times: its one segment's kernel arguments
        # are computed once (the tensors live as long as self).
        _, seg = self.segments[0]
        args = (seg.data.data_ptr(), seg.data.stride(0), seg.ggml_type, self.rows, self.cols)
        object.__setattr__(self, "_single", args if len(self.segments) == 1 else None)
        object.__setattr__(self, "_rows_max", {
            dtype: min(rows_max(seg.ggml_type, dtype) for _, seg in self.segments)
            for dtype in _OUT_DTYPES})

    def rows_max(self, x_dtype: torch.dtype) -> int:
        """The most rows of x in x_dtype whose product takes the row kernels for every segment."""
        return self._rows_max.get(x_dtype, ROWS_MAX_BF16)  # type: ignore[attr-defined]

    def matmul(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """x [..., K] @ W.T -> [..., N] in out_dtype (default x's dtype)."""
        single = self._single  # type: ignore[attr-defined]
        dtype = out_dtype or x.dtype
        if single is not None and x.dim() == 2 and x.shape[0] <= self.rows_max(x.dtype) and \
                x.dtype in _OUT_DTYPES and dtype in _OUT_DTYPES and x.stride(1) == 1 and \
                x.shape[1] == self.cols:
            out = torch.empty(x.shape[0], self.rows, dtype=dtype)
            ptr, stride, ggml_type, rows, cols = single
            rc = native_kernels.lib().quant_matmul(
                out.data_ptr(), rows, _OUT_DTYPES[dtype], x.data_ptr(), x.stride(0),
                _OUT_DTYPES[x.dtype], ptr, stride, ggml_type, x.shape[0], rows, cols, _threads())
            _check(rc, "quant_matmul")
            return out
        return self._matmul_general(x, dtype)

    def _matmul_general(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        if x2.dtype not in _OUT_DTYPES or x2.stride(-1) != 1:
            x2 = x2.float().contiguous()
        out = torch.empty(x2.shape[0], self.rows,
                          dtype=dtype if dtype in _OUT_DTYPES else torch.float32)
        for offset, seg in self.segments:
            rows = x2.shape[0] <= rows_max(seg.ggml_type, x2.dtype)
            (matmul_into if rows else gemm_into)(out.narrow(1, offset, seg.shape[0]), x2, seg)
        out = out if out.dtype == dtype else out.to(dtype)
        return out.view(*lead, self.rows)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return torch.cat([seg.dequantize(dtype) for _, seg in self.segments])

    def nbytes(self) -> int:
        return sum(seg.data.numel() for _, seg in self.segments)


def _back_to_back(a: QuantizedTensor, b: QuantizedTensor) -> bool:
    """Whether b's rows follow a's in the same memory, in the same layout."""
    return a.ggml_type == b.ggml_type and a.source_type == b.source_type and \
        a.data.is_contiguous() and b.data.is_contiguous() and \
        a.data.shape[1] == b.data.shape[1] and \
        a.data.untyped_storage().data_ptr() == b.data.untyped_storage().data_ptr() and \
        a.data.data_ptr() + a.data.numel() == b.data.data_ptr()


def _segment(pieces: list[QuantizedTensor], repack: bool = True) -> QuantizedTensor:
    """One tensor of the pieces' rows in order: a view where they are back to back and keep
    their layout; else written once into new memory (repacked where repacked_type says), the
    source pages then given back (file_map.drop_pages: a file's pages would stay resident).
    A weight that products stream (`repack`: not an embedding only looked up) is written into
    huge pages even where a view would do: the file's pages are small (model/huge_pages.py;
    AMX Xeon, 2 threads, batch 1: the 1B Q4_K_M 1.36x at avx2 and 1.31x native, the default
    model 1.06x native and 1.06-1.15x at avx2, same RSS)."""
    first, rows = pieces[0], sum(p.shape[0] for p in pieces)
    # A tile may not straddle two pieces (each is repacked on its own).
    kind = repacked_type(first, tiled=all(p.shape[0] % 16 == 0 for p in pieces)) \
        if repack else None
    if kind is None and not (repack and huge_pages_on()) and \
            all(_back_to_back(a, b) for a, b in pairwise(pieces)):
        data = first.data.as_strided((rows, first.data.shape[1]), first.data.stride())
        return QuantizedTensor(data, first.ggml_type, first.cols, first.source_type)
    row_bytes = _row_bytes(kind, first.cols) if kind else first.data.shape[1]
    data = weight_memory(rows, row_bytes)
    start = 0
    for piece in pieces:
        dst = data.narrow(0, start, piece.shape[0])
        if kind:
            repack_into(piece, dst, kind)
        else:
            dst.copy_(piece.data)
        drop_pages(piece.data)
        start += piece.shape[0]
    if kind:
        return QuantizedTensor(data, kind, first.cols, first.ggml_type)
    return QuantizedTensor(data, first.ggml_type, first.cols, first.source_type)
