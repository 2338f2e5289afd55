"""A decode step through a stage's whole stack of quantized decoder layers in one C call
(csrc/decode_layers.c, whose header lists the per-layer sequence).

Applies to steps whose rows are all decodes, any number of them (each product takes the row
kernels up to its segment's quant_rows_max.rows_max rows and the panel GEMM past them, as the
layer-by-layer path chooses; a verify step of 1 + k speculative positions is such rows too),
with one tensor-parallel rank (nothing to all-reduce between the products), the native kernels
built, and every linear of every layer quantized, in up to three row segments (a Q4_K_M file's
q/k/v mixes Q4_K and Q6_K). The C side calls the same kernels the layer-by-layer path calls, segment
by segment, in the same order, so the hidden states are bit-identical; what goes is ~2 ms of
Python a step on the default model (SHARDSERVE_FUSED_DECODE=0 turns it off).

The layer table (weight pointers, row strides, types) is built once per loaded model; the KV
cache pointers are refreshed whenever the caches handed in change.
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING

import torch

from shardserve import envs
from shardserve.distributed.parallel_state import get_tp_group
from shardserve.model import native_kernels, quant_rows_max

if TYPE_CHECKING:
    from shardserve.model.attention import AttentionMetadata
    from shardserve.model.layers import MatmulLayer
    from shardserve.model.llama import LlamaDecoderLayer
    from shardserve.model.rotary import RopeStep

_i64, _ptr, _f32, _i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int32
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


class _Segment(ctypes.Structure):
    _fields_ = [("w", _ptr), ("row_bytes", _i64), ("rows", _i64), ("type", _i32),
                ("rows_max", _i32)]


_MAX_SEGMENTS = 3  # decode_layers.c's DL_MAX_SEGMENTS


class _Matrix(ctypes.Structure):
    _fields_ = [("seg", _Segment * _MAX_SEGMENTS), ("nseg", _i64), ("rows", _i64)]


class _Lora(ctypes.Structure):
    _fields_ = [("at", _ptr), ("bt", _ptr), ("seg_ends", _ptr), ("slots", _i64), ("rank", _i64),
                ("nseg", _i64), ("wdtype", _i64)]


class _Layer(ctypes.Structure):
    _fields_ = [("input_norm", _ptr), ("post_norm", _ptr), ("qkv_bias", _ptr),
                ("kv_cache", _ptr), ("qkv", _Matrix), ("o", _Matrix), ("gate_up", _Matrix),
                ("down", _Matrix), ("lora_qkv", _Lora), ("lora_o", _Lora),
                ("lora_gate_up", _Lora), ("lora_down", _Lora)]


class _Step(ctypes.Structure):
    _fields_ = [(name, _i64) for name in ("B", "hidden", "heads", "kv_heads", "head_dim",
                                           "inter", "block_size", "bt_stride")] + \
        [(name, _ptr) for name in ("positions", "slots", "block_table", "seq_lens",
                                   "rope_table", "x", "residual", "h", "qkv", "attn",
                                   "gate_up", "act")] + \
        [("eps", _f32), ("scale", _f32), ("dtype", _i32), ("has_residual", _i32),
         ("num_threads", _i32), ("kv_dtype", _i32), ("lora_slots", _ptr)]


def _matrix(layer: MatmulLayer, dtype: torch.dtype) -> _Matrix | None:
    """The kernel arguments of a quantized weight (its row segments in order, a Q4_K_M file's
    mixed q/k/v too); None for anything else."""
    qweight = layer.qweight
    if qweight is None or len(qweight.segments) > _MAX_SEGMENTS:
        return None
    segs, row = [], 0
    for offset, seg in qweight.segments:
        if offset != row:
            return None
        segs.append(_Segment(seg.data.data_ptr(), seg.data.stride(0), seg.shape[0],
                             seg.ggml_type, quant_rows_max.rows_max(seg.ggml_type, dtype)))
        row += seg.shape[0]
    matrix = _Matrix(nseg=len(segs), rows=qweight.rows)
    for i, seg in enumerate(segs):
        matrix.seg[i] = seg
    return matrix


def _lora(layer: MatmulLayer) -> _Lora | None:
    """The kernel arguments of a layer's adapter slots (model/lora.py): empty where it has none,
    None where the C kernel cannot read them (then steps with adapters take the layer path)."""
    w = getattr(layer, "lora", None)
    if w is None:
        return _Lora()
    if w.dtype not in _DTYPES or w.at.device.type != "cpu":
        return None
    slots, _, rank = w.at.shape
    return _Lora(w.at.data_ptr(), w.bt.data_ptr(), w.seg_ends.data_ptr(), slots, rank,
                 w.seg_ends.numel(), _DTYPES[w.dtype])


class FusedDecode:
    """The layer table of one stage, and the call that runs a decode step through it."""

    def __init__(self, layers: list[LlamaDecoderLayer], dtype: torch.dtype,
                 table: ctypes.Array, takes_lora: bool) -> None:
        first = layers[0]
        attn, mlp = first.self_attn, first.mlp
        self.dtype = dtype
        self.table = table
        self.num_layers = len(layers)
        self.hidden = first.input_layernorm.weight.shape[0]
        self.heads, self.kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.inter = mlp.local_inter
        self.eps = first.input_layernorm.eps
        self._layers = layers  # the table points into their tensors
        self._cache_ptrs: tuple[int, ...] = ()
        qkv_lora = attn.qkv_proj.lora
        self._lora_batch = None if qkv_lora is None else qkv_lora.batch
        self.takes_lora = takes_lora  # False: the adapters' slots do not fit the C side
        self._scratch_rows, self._scratch_bufs = 0, []  # see _scratch
        self._rope_of: torch.Tensor | None = None  # see _rope_floats
        self._rope_view = torch.empty(0)

    @classmethod
    def build(cls, layers: list[LlamaDecoderLayer], dtype: torch.dtype) -> FusedDecode | None:
        """The fused path for these layers, or None where it does not apply."""
        if not layers or not envs.fused_decode() or dtype not in _DTYPES or \
                get_tp_group().world_size != 1 or \
                not native_kernels.supports(dtype, torch.device("cpu")):
            return None
        entries, takes_lora = [], True
        for layer in layers:
            attn, mlp = layer.self_attn, layer.mlp
            modules = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            mats = [_matrix(m, dtype) for m in modules]
            loras = [_lora(m) for m in modules]
            takes_lora = takes_lora and all(entry is not None for entry in loras)
            norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
            bias = attn.qkv_proj.bias
            tensors = [*norms] + ([] if bias is None else [bias])
            if any(m is None for m in mats) or attn.o_proj.bias is not None or any(
                t.dtype != dtype or t.device.type != "cpu" or not t.is_contiguous()
                for t in tensors
            ):
                return None
            entries.append(_Layer(norms[0].data_ptr(), norms[1].data_ptr(),
                                  None if bias is None else bias.data_ptr(), None, *mats,
                                  *(entry or _Lora() for entry in loras)))
        return cls(layers, dtype, (_Layer * len(entries))(*entries), takes_lora)

    def applies(self, meta: AttentionMetadata, x: torch.Tensor) -> bool:
        """Whether this step can run fused: decode rows only, in flat order."""
        g = meta.decode
        return (
            g is not None and meta.prefill is None and g.query_index is None
            and meta.context is None  # context parallel attention runs layer by layer
            and meta.output_index is None
            and x.dtype == self.dtype and x.device.type == "cpu"
            and (self.takes_lora or not self._lora_active())
        )

    def _lora_active(self) -> bool:
        return self._lora_batch is not None and self._lora_batch.active

    def run(self, x: torch.Tensor, residual: torch.Tensor | None, meta: AttentionMetadata,
            rope: RopeStep, kv_caches: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The stack's (hidden, residual) output for the decode step's input x [B, hidden]."""
        self._point_at(kv_caches)
        b = x.shape[0]
        g = meta.decode
        assert g is not None
        # Both are written in place: never the caller's tensors (the residual is updated in
        # place on the layer-by-layer path too, but x may be a buffer the caller reuses).
        x = x.contiguous().clone()
        out_residual = torch.empty_like(x) if residual is None else residual.contiguous()
        scratch = self._scratch(b)
        blocks = g.blocks.contiguous()
        index_tensors = [meta.positions.contiguous(), meta.slot_mapping.contiguous(), blocks,
                         g.seq_lens.contiguous()]
        rope_table = self._rope_floats(rope.table)
        step = _Step(
            b, self.hidden, self.heads, self.kv_heads, self.head_dim, self.inter,
            kv_caches[0].shape[1], blocks.numel() // b,
            *(t.data_ptr() for t in index_tensors), rope_table.data_ptr(), x.data_ptr(),
            out_residual.data_ptr(), *(t.data_ptr() for t in scratch),
            self.eps, self.head_dim**-0.5, _DTYPES[self.dtype], int(residual is not None),
            torch.get_num_threads(), _DTYPES[kv_caches[0].dtype], self._lora_slots(b),
        )
        rc = native_kernels.lib().decode_layers(self.table, self.num_layers, ctypes.byref(step))
        if rc:
            raise MemoryError(f"decode_layers: kernel error {rc} (out of scratch memory)")
        return x, out_residual

    def _scratch(self, b: int) -> list[torch.Tensor]:
        """The C side's scratch for b rows (h, qkv, attn, gate_up, act), kept from the last
        step of that many rows: only decode_layers writes them, and only during its call."""
        if self._scratch_rows != b:
            q_size, kv_size = self.heads * self.head_dim, self.kv_heads * self.head_dim
            self._scratch_bufs = [torch.empty(b, n, dtype=self.dtype) for n in (
                self.hidden, q_size + 2 * kv_size, q_size, 2 * self.inter, self.inter)]
            self._scratch_rows = b
        return self._scratch_bufs

    def _rope_floats(self, table: torch.Tensor) -> torch.Tensor:
        """The RoPE table as float32 (cos, sin) pairs, viewed once per table (it is rebuilt,
        not changed in place, when it grows)."""
        if self._rope_of is not table:
            self._rope_of, self._rope_view = table, torch.view_as_real(table).contiguous()
        return self._rope_view

    def _lora_slots(self, rows: int) -> int | None:
        """The step's int32 adapter slot per row, for the C side; None without adapters."""
        if not self._lora_active():
            return None
        slots = self._lora_batch.slots  # type: ignore[union-attr]
        assert slots is not None and slots.numel() == rows and slots.dtype == torch.int32
        return slots.data_ptr()

    def _point_at(self, kv_caches: list[torch.Tensor]) -> None:
        ptrs = tuple(c.data_ptr() for c in kv_caches)
        if ptrs == self._cache_ptrs:
            return
        slot = 2 * self.kv_heads * self.head_dim
        for cache in kv_caches:
            if not native_kernels.kv_dtype_ok(self.dtype, cache.dtype) or \
                    cache.dtype != kv_caches[0].dtype or \
                    not cache.is_contiguous() or cache[0, 0].numel() != slot or \
                    cache.device.type != "cpu":
                raise ValueError(f"KV cache {tuple(cache.shape)} {cache.dtype} does not fit "
                                 f"the fused decode path ({self.dtype}, {slot} per slot)")
        if len(ptrs) != self.num_layers:
            raise ValueError(f"expected {self.num_layers} KV caches, got {len(ptrs)}")
        for entry, ptr in zip(self.table, ptrs, strict=True):
            entry.kv_cache = ptr
        self._cache_ptrs = ptrs
