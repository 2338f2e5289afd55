"""Reading GGUF files: metadata, architecture facts and dequantized weights under HF names.

`gguf.GGUFReader` decodes every metadata array element into numpy objects up front, which takes
over 2 s for a 49k-token vocabulary. We only need a handful of scalars plus the token lists, so
this module walks the header itself (GGUF v2/v3 layout) and memory-maps the tensor data; the
dequantization kernels are still `gguf.quants.dequantize`.
"""

from __future__ import annotations

import mmap
import os
import re
import struct
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from shardserve.config.model_arch import SUPPORTED_ARCHITECTURES, ModelArch
from shardserve.model.file_map import drop_pages, file_tensor
from shardserve.model.quantization import QuantizedTensor, is_kept_type

# GGUF general.architecture -> the HF class whose parameter layout the file holds.
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}

_MAGIC = b"GGUF"
# GGUF metadata value types -> struct format of a scalar of that type.
_SCALAR_FORMATS = {
    0: "B",
    1: "b",
    2: "H",
    3: "h",
    4: "I",
    5: "i",
    6: "f",
    7: "?",
    10: "Q",
    11: "q",
    12: "d",
}
_NUMPY_DTYPES = {
    0: "u1",
    1: "i1",
    2: "<u2",
    3: "<i2",
    4: "<u4",
    5: "<i4",
    6: "<f4",
    7: "?",
    10: "<u8",
    11: "<i8",
    12: "<f8",
}
_STRING, _ARRAY, _FLOAT32 = 8, 9, 6


class GGUFFormatError(ValueError):
    """The file is not a readable GGUF (bad magic, truncated, unknown value type)."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy / HF order (GGUF stores ne0 first; this is reversed)
    ggml_type: int
    offset: int  # absolute byte offset of the data in the file


@dataclass(frozen=True)
class GGUFFile:
    path: Path
    metadata: dict[str, Any]
    tensors: tuple[TensorInfo, ...]


_U64 = struct.Struct("<Q")


class _Cursor:
    """Little-endian reader over a buffer; every read is bounds-checked by struct/numpy."""

    def __init__(self, buf: memoryview) -> None:
        self.buf, self.pos = buf, 0

    def scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.scalar("Q")
        if self.pos + n > len(self.buf):
            raise GGUFFormatError("string runs past the end of the file")
        text = bytes(self.buf[self.pos : self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return text

    def value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            return self.array()
        if vtype == _FLOAT32:
            # GGUF stores float32; the shortest repr that round-trips in float32 recovers the
            # value the original config held (1e-05, not 9.999999747378752e-06).
            return float(str(np.float32(self.scalar("f"))))
        if vtype not in _SCALAR_FORMATS:
            raise GGUFFormatError(f"unknown metadata value type {vtype}")
        return self.scalar(_SCALAR_FORMATS[vtype])

    def strings(self, count: int) -> list[str]:
        """`count` strings in a row: the tokenizer's vocabulary and merges (~98k in the default
        model), in one tight loop (0.31 s of the cold start through string(), now 0.04 s)."""
        buf, pos, size, out = self.buf, self.pos, len(self.buf), []
        unpack, append = _U64.unpack_from, out.append
        for _ in range(count):
            (n,) = unpack(buf, pos)
            pos += 8
            if pos + n > size:
                raise GGUFFormatError("string runs past the end of the file")
            append(str(buf[pos : pos + n], "utf-8", "replace"))
            pos += n
        self.pos = pos
        return out

    def array(self) -> list[Any]:
        item_type, count = self.scalar("I"), self.scalar("Q")
        if item_type == _STRING:
            return self.strings(count)
        if item_type in _NUMPY_DTYPES:
            dtype = np.dtype(_NUMPY_DTYPES[item_type])
            end = self.pos + count * dtype.itemsize
            if end > len(self.buf):
                raise GGUFFormatError("array runs past the end of the file")
            values = np.frombuffer(self.buf[self.pos : end], dtype=dtype).tolist()
            self.pos = end
            return values
        return [self.value(item_type) for _ in range(count)]


def _parse(buf: memoryview, path: Path) -> GGUFFile:
    cur = _Cursor(buf)
    if bytes(buf[:4]) != _MAGIC:
        raise GGUFFormatError("not a GGUF file (bad magic)")
    cur.pos = 4
    version = cur.scalar("I")
    if version not in (2, 3):
        raise GGUFFormatError(f"unsupported GGUF version {version}")
    n_tensors, n_kv = cur.scalar("Q"), cur.scalar("Q")
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string()
        metadata[key] = cur.value(cur.scalar("I"))
    raw: list[tuple[str, tuple[int, ...], int, int]] = []
    for _ in range(n_tensors):
        name = cur.string()
        dims = tuple(cur.scalar("Q") for _ in range(cur.scalar("I")))
        raw.append((name, dims[::-1], cur.scalar("I"), cur.scalar("Q")))
    align = int(metadata.get("general.alignment", 32))
    data_start = (cur.pos + align - 1) // align * align
    tensors = tuple(TensorInfo(n, s, t, data_start + o) for n, s, t, o in raw)
    for t in tensors:
        if t.offset + _nbytes(t) > len(buf):
            raise GGUFFormatError(f"tensor {t.name} runs past the end of the file (truncated?)")
    return GGUFFile(path, metadata, tensors)


def _nbytes(t: TensorInfo) -> int:
    if t.ggml_type not in GGML_QUANT_SIZES:
        raise GGUFFormatError(f"tensor {t.name} has unknown ggml type {t.ggml_type}")
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType(t.ggml_type)]
    return int(np.prod(t.shape, dtype=np.int64)) // block * size


@lru_cache(maxsize=8)
def _read_cached(path: str, mtime_ns: int, size: int) -> tuple[GGUFFile, mmap.mmap]:
    with open(path, "rb") as f:
        if size == 0:
            raise GGUFFormatError("empty file")
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        return _parse(memoryview(mm), Path(path)), mm
    except (struct.error, UnicodeDecodeError, OverflowError, ValueError) as e:
        # No mm.close(): views into it may still be alive in the traceback; GC unmaps it.
        if isinstance(e, GGUFFormatError):
            raise
        raise GGUFFormatError(f"truncated or corrupt GGUF ({e})") from e


def read_gguf(path: Path) -> tuple[GGUFFile, mmap.mmap]:
    """Parsed header plus a read-only map of the file, cached per (path, mtime, size)."""
    st = os.stat(path)
    try:
        return _read_cached(str(Path(path).resolve()), st.st_mtime_ns, st.st_size)
    except GGUFFormatError as e:
        raise GGUFFormatError(f"{path}: {e}") from None


def gguf_arch(path: Path) -> ModelArch:
    """ModelArch from GGUF metadata (llama.cpp key names, prefixed by general.architecture)."""
    gf, _ = read_gguf(path)
    md = gf.metadata
    name = md.get("general.architecture")
    if name not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"{path}: GGUF architecture {name!r} is not supported; supported GGUF architectures: "
            f"{', '.join(GGUF_ARCHITECTURES)} (HF: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    hidden, heads = md[f"{name}.embedding_length"], md[f"{name}.attention.head_count"]
    eos = md.get("tokenizer.ggml.eos_token_id")
    names = {t.name for t in gf.tensors}
    vocab = len(md.get("tokenizer.ggml.tokens") or []) or md.get(f"{name}.vocab_size")
    return ModelArch(
        architecture=GGUF_ARCHITECTURES[name],
        vocab_size=int(vocab or _embedding_rows(gf)),
        hidden_size=int(hidden),
        intermediate_size=int(md[f"{name}.feed_forward_length"]),
        num_layers=int(md[f"{name}.block_count"]),
        num_heads=int(heads),
        num_kv_heads=int(md.get(f"{name}.attention.head_count_kv", heads)),
        head_dim=int(md.get(f"{name}.attention.key_length", hidden // heads)),
        rope_theta=float(md.get(f"{name}.rope.freq_base", 10000.0)),
        rope_scaling=_gguf_rope_scaling(md, name),
        rms_norm_eps=float(md.get(f"{name}.attention.layer_norm_rms_epsilon", 1e-6)),
        tie_word_embeddings="output.weight" not in names,
        max_position_embeddings=int(md.get(f"{name}.context_length", 2048)),
        attention_bias="blk.0.attn_q.bias" in names,
        bos_token_id=md.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (int(eos),),
    )


def has_kept_quantized_weights(path: Path) -> bool:
    """Whether any matrix in the file is of a type the quantized kernels compute with."""
    gf, _ = read_gguf(path)
    return any(len(t.shape) == 2 and is_kept_type(t.ggml_type) for t in gf.tensors)


def _embedding_rows(gf: GGUFFile) -> int:
    return next(t.shape[0] for t in gf.tensors if t.name == "token_embd.weight")


def _gguf_rope_scaling(md: dict[str, Any], name: str) -> dict | None:
    """llama.cpp's rope.scaling.* keys as an HF rope_scaling dict (linear / yarn); else None."""
    kind = md.get(f"{name}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    scaling: dict[str, Any] = {"rope_type": kind, "factor": md.get(f"{name}.rope.scaling.factor")}
    original = md.get(f"{name}.rope.scaling.original_context_length")
    if original is not None:
        scaling["original_max_position_embeddings"] = int(original)
    return scaling


# GGUF tensor-name pieces -> HF parameter-name pieces (llama.cpp's standard names).
_TOP_LEVEL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")


def hf_name(gguf_name: str) -> str | None:
    """HF parameter name for a GGUF tensor name, or None for tensors we do not use."""
    if gguf_name in _TOP_LEVEL:
        return _TOP_LEVEL[gguf_name]
    m = _BLOCK_RE.match(gguf_name)
    if m is None or m.group(2) not in _BLOCK:
        return None
    return f"model.layers.{m.group(1)}.{_BLOCK[m.group(2)]}.{m.group(3)}"


def unpermute_rope_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo convert_hf_to_gguf's Q/K row permutation for llama-arch files.

    The converter reorders each head's rows from HF's rotate-half layout (first half / second half
    of head_dim) to llama.cpp's interleaved pairs: HF row (h, j, i) with j in {0, 1} ends up at
    GGUF row (h, i, j). Reading GGUF rows as (h, i, j) and swapping back gives (h, j, i).
    """
    rows = w.shape[0]
    half = rows // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tensor_loader(gf: GGUFFile, buf: mmap.mmap, arch: ModelArch, keep_quantized: bool
                   ) -> Callable[[TensorInfo], Any]:
    permute = gf.metadata.get("general.architecture") == "llama"
    file = file_tensor(buf)

    def load(t: TensorInfo) -> torch.Tensor | QuantizedTensor:
        if keep_quantized and len(t.shape) == 2 and is_kept_type(t.ggml_type):
            return _quantized(t)
        raw = np.frombuffer(buf, dtype=np.uint8, count=_nbytes(t), offset=t.offset)
        qtype = GGMLQuantizationType(t.ggml_type)
        try:
            values = dequantize(raw.reshape(*t.shape[:-1], -1), qtype)
        except NotImplementedError as e:
            raise ValueError(f"{gf.path}: tensor {t.name}: {qtype.name} is not supported") from e
        values = hf_rows(t, values.reshape(t.shape))
        if not values.flags.writeable or values.dtype != np.float32:
            values = values.astype(np.float32)  # F32 tensors come back as views of the mmap
        drop_pages(file.narrow(0, t.offset, _nbytes(t)))  # only the float copy is used
        return torch.from_numpy(np.ascontiguousarray(values))

    def _quantized(t: TensorInfo) -> QuantizedTensor:
        """The blocks where they lie in the file (no copy). llama-arch Q/K rows stay in the
        file's interleaved RoPE order: the model computes in that order (QKVParallelLinear),
        so un-permuting them to HF's here would only be undone there."""
        rows = file.narrow(0, t.offset, _nbytes(t)).view(t.shape[0], -1)
        interleaved = permute and (".attn_q." in t.name or ".attn_k." in t.name)
        return QuantizedTensor(rows, t.ggml_type, t.shape[1], rope_interleaved=interleaved)

    def hf_rows(t: TensorInfo, rows: np.ndarray) -> np.ndarray:
        """Q/K rows back in HF's order (llama-arch files); other tensors unchanged."""
        if permute and ".attn_q." in t.name:
            return unpermute_rope_rows(rows, arch.num_heads)
        if permute and ".attn_k." in t.name:
            return unpermute_rope_rows(rows, arch.num_kv_heads)
        return rows

    return load


def iter_gguf_weights(
    path: Path, workers: int = 2, window: int = 8, keep_quantized: bool = False
) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
    """(HF name, float32 tensor) pairs in file order; with `keep_quantized`, 2-D tensors of a
    type the quantized kernels take come as QuantizedTensor blocks instead: views of the file
    map, llama-arch Q/K rows in the file's order (`rope_interleaved`, see _tensor_loader).

    numpy's ufuncs release the GIL, so a small thread pool dequantizes ahead of the consumer;
    `window` bounds how many finished tensors can wait in memory.
    """
    gf, buf = read_gguf(path)
    arch = gguf_arch(path)
    wanted = [(n, t) for t in gf.tensors if (n := hf_name(t.name)) is not None]
    load = _tensor_loader(gf, buf, arch, keep_quantized)
    with ThreadPoolExecutor(max_workers=workers) as pool:
        pending: deque[tuple[str, Future[torch.Tensor | QuantizedTensor]]] = deque()
        todo = iter(wanted)
        for name, t in todo:
            pending.append((name, pool.submit(load, t)))
            if len(pending) >= window:
                break
        while pending:
            name, fut = pending.popleft()
            nxt = next(todo, None)
            if nxt is not None:
                pending.append((nxt[0], pool.submit(load, nxt[1])))
            yield name, fut.result()
