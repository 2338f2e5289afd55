"""The layer that multiplies: x @ weight.T from the dense weight, a oneDNN-prepacked copy of it,
or quantized blocks (quantization.py). The sharded linears and the vocabulary layers of
layers.py all derive from it; the choice of kernel lives here only."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shardserve import envs
from shardserve.model import quantization
from shardserve.model.quantization import QuantizedTensor, QuantWeight


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight.T (+ bias), choosing the kernel that suits the weight's storage order."""
    if weight.stride(-1) == 1:
        return F.linear(x, weight, bias)
    out = torch.matmul(x, weight.t())  # weight.t() is a contiguous [in, out] matrix
    return out if bias is None else out.add_(bias)


def _mkldnn_pack(weight: torch.Tensor) -> torch.Tensor | None:
    """oneDNN-prepacked copy of a bf16/fp32 CPU weight, or None where that does not apply.

    Measured on this project's 2-core AVX-512 CPU: prepacked bf16 matmuls run ~1.7x faster than
    `F.linear` for batch-1 decode (identical results); prepacked fp32 runs 1.6-2x faster than MKL's
    sgemm for batches of 2-128 rows (and 2-4x for 2-16 rows, where sgemm's small-M path is slow),
    on par at 1 row; results differ from sgemm only by summation order (~1e-6 relative).
    """
    if weight.dtype not in (torch.bfloat16, torch.float32) or weight.device.type != "cpu":
        return None
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)
    except (RuntimeError, AttributeError):
        return None


class MatmulLayer(nn.Module):
    """A layer computing x @ weight.T, from a prepacked copy of the weight or a quantized one.

    After `pack_weight()` the packed copy is the source of truth and (unless keep_dense) the
    parameter becomes a stride-0 placeholder with the right shape, so no memory is doubled.
    `unpack_weight()` restores the dense parameter (done before any reload).

    Quantized (see quantization.py): a GGUF loader hands over QuantizedTensor pieces, collected
    by `load_quantized` and turned into `qweight` by `finalize_quantized`; `quantize_int8`
    quantizes the loaded dense weight. Either way the dense parameter becomes a placeholder.
    """

    weight: nn.Parameter
    packed: torch.Tensor | None = None
    qweight: QuantWeight | None = None
    _dense_dropped: bool = False

    def pack_weight(self, keep_dense: bool = False) -> None:
        if self.qweight is not None:
            return  # packed (or not) with the quantized weight, by _set_qweight
        self.unpack_weight()
        packed = _mkldnn_pack(self.weight.data)
        if packed is None:
            return
        self.packed = packed
        if not keep_dense:
            self._drop_dense()

    def _drop_dense(self) -> None:
        w = self.weight.data
        self.weight.data = torch.empty(1, dtype=w.dtype).as_strided(w.shape, (0,) * w.dim())
        self._dense_dropped = True

    def unpack_weight(self) -> None:
        if self.qweight is not None:
            self.weight.data = torch.empty(self.weight.shape, dtype=self.weight.dtype)
            self.qweight, self._dense_dropped = None, False
        if self.packed is None:
            return
        if self._dense_dropped:
            self.weight.data = self.packed.to_dense()
            self._dense_dropped = False
        self.packed = None

    def load_quantized(self, piece: QuantizedTensor, row_offset: int) -> None:
        """Keep `piece` (this rank's rows of one stacked matrix) for finalize_quantized."""
        self.__dict__.setdefault("_qpieces", {})[row_offset] = piece

    def quantized_types(self) -> set[int]:
        """The ggml types of the pieces load_quantized holds (until finalize_quantized)."""
        return {p.ggml_type for p in self.__dict__.get("_qpieces", {}).values()}

    def finalize_quantized(self, join_apart: bool = True, repack: bool = True) -> None:
        """After loading: keep the weight quantized when every row arrived quantized and the
        kernels run here (join_apart: see QuantWeight.from_pieces); otherwise dequantize the
        quantized pieces into the dense weight."""
        pieces: dict[int, QuantizedTensor] = self.__dict__.pop("_qpieces", {})
        if not pieces:
            return
        rows = self.weight.shape[0]
        if sum(p.shape[0] for p in pieces.values()) == rows and quantization.available():
            self._set_qweight(QuantWeight.from_pieces(pieces, rows, join_apart, repack))
            return
        for offset, piece in pieces.items():
            self.weight.data.narrow(0, offset, piece.shape[0]).copy_(piece.dequantize())

    def quantize_int8(self) -> None:
        """Per-output-channel int8 of the loaded dense weight (where the kernels run and the
        input size is whole blocks of 32; otherwise the weight stays dense)."""
        if self.qweight is not None or not quantization.available():
            return
        self.unpack_weight()
        qt = quantization.quantize_int8(self.weight.data)
        if qt is not None:
            self._set_qweight(QuantWeight.from_pieces({0: qt}, qt.shape[0]))

    def _set_qweight(self, qweight: QuantWeight) -> None:
        """Compute from `qweight`; for batched steps also from a prepacked dense copy of it
        (SHARDSERVE_QUANT_DENSE_BATCHES), the dense parameter dropped either way."""
        self.qweight, self.packed = qweight, None
        if envs.quant_dense_batches():
            self.packed = _mkldnn_pack(qweight.dequantize(self.weight.dtype))
        self._drop_dense()

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None,
                out_dtype: torch.dtype | None = None) -> torch.Tensor:
        if self.qweight is not None and (self.packed is None or x.numel() <=
                                         self.qweight.rows_max(x.dtype) * x.shape[-1]):
            out = self.qweight.matmul(x, out_dtype)
            return out if bias is None else out.add_(bias)
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")
        return linear(x, self.weight, bias)
