"""CPU kernels in C (csrc/cpu_kernels.c), compiled on first use and called through ctypes.

Why C: decode attention over a paged cache is a few small dot products per cached row. Stock
PyTorch has to gather every request's blocks into a padded copy and then run SDPA, whose CPU
kernel is tuned for long query blocks and runs decode shapes at a fraction of its speed. The C
kernel reads K/V rows where they lie, once per step, with float32 accumulation.

Build: `gcc -O3 -march=native -fopenmp -shared` into a cache folder (SHARDSERVE_CACHE_DIR, default
~/.cache/shardserve), named by a hash of the source, the flags, the compiler and the CPU's flags,
so an edit, another compiler or another CPU gets its own library. The library is written to a
temporary name and renamed, so processes building at once never load a half-written file.
Where the build fails (no compiler) every caller falls back to the PyTorch path, with one warning;
SHARDSERVE_NATIVE_KERNELS=0 forces that fallback (tests compare the two).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from shardserve import envs

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "cpu_kernels.c"
# No -ffast-math: it would link code that sets flush-to-zero for the whole process. These flags
# allow reordering float sums (vectorised dot products) and nothing else.
_FLAGS = [
    "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-fno-math-errno",
    "-fno-trapping-math", "-fassociative-math", "-fno-signed-zeros",
]
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_BUILD_TIMEOUT_S = 120.0


def supports(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the native kernels handle tensors of this dtype on this device."""
    return device.type == "cpu" and dtype in _DTYPES and library() is not None


@functools.cache
def library() -> ctypes.CDLL | None:
    """The loaded kernel library, or None where it is disabled or cannot be built."""
    if not envs.native_kernels():
        return None
    try:
        lib = ctypes.CDLL(str(_build()))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        logger.warning("native CPU kernels unavailable (%s); using the PyTorch path", e)
        return None
    _declare(lib)
    return lib


def _build() -> Path:
    compiler = shutil.which(os.environ.get("CC", "gcc"))
    if compiler is None:
        raise RuntimeError("no C compiler (gcc) on PATH")
    source = _SOURCE.read_bytes()
    key = hashlib.sha256(
        source + " ".join(_FLAGS).encode() + _compiler_version(compiler) + _cpu_flags()
    ).hexdigest()[:16]
    cache = Path(envs.cache_dir()) / "kernels"
    target = cache / f"cpu_kernels-{key}.so"
    if target.exists():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".cpu_kernels-", suffix=".so", dir=cache)
    os.close(fd)
    try:
        cmd = [compiler, *_FLAGS, str(_SOURCE), "-o", tmp]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=_BUILD_TIMEOUT_S)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr.strip()}")
        os.replace(tmp, target)  # atomic: a concurrent builder replaces it with the same bytes
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _compiler_version(compiler: str) -> bytes:
    out = subprocess.run([compiler, "--version"], capture_output=True, timeout=30)
    return out.stdout


def _cpu_flags() -> bytes:
    try:
        with open("/proc/cpuinfo", "rb") as f:
            return next((line for line in f if line.startswith(b"flags")), b"")
    except OSError:
        return b""


def _declare(lib: ctypes.CDLL) -> None:
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.decode_attention.restype = ctypes.c_int
    lib.decode_attention.argtypes = [
        ptr, ptr, ptr, i64, ptr, ptr, i64, ptr, i64, i64, i64, i64, i64,
        ctypes.c_float, ctypes.c_int, ctypes.c_int,
    ]


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    q_rows: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Attention of one query per request over its paged context; returns [B, H * D].

    q: [T, H, D] with unit stride inside a row (rows may be strided, e.g. a view into qkv);
    request r's query is row q_rows[r] (default r). kv_cache: [num_blocks, block_size, 2, Hkv, D]
    contiguous. block_table: int64 [B, W] contiguous rows; seq_lens: int64 [B], context lengths
    including this step's token, whose K/V must already be in the cache.
    """
    lib = library()
    assert lib is not None, "decode_attention called without the native library"
    _, num_heads, head_dim = q.shape
    num_blocks, block_size, two, num_kv, kv_dim = kv_cache.shape
    b = block_table.shape[0]
    if q.stride(2) != 1 or q.stride(1) != head_dim or not kv_cache.is_contiguous():
        raise ValueError("decode_attention needs unit-stride query rows and a contiguous cache")
    if two != 2 or kv_dim != head_dim or num_heads % num_kv or q.dtype != kv_cache.dtype:
        raise ValueError(f"shape/dtype mismatch: q {tuple(q.shape)} {q.dtype}, "
                         f"cache {tuple(kv_cache.shape)} {kv_cache.dtype}")
    block_table = block_table.contiguous()
    seq_lens = seq_lens.contiguous()
    out = torch.empty(b, num_heads * head_dim, dtype=q.dtype)
    rc = lib.decode_attention(
        out.data_ptr(), q.data_ptr(), _ptr(q_rows), q.stride(0), kv_cache.data_ptr(),
        block_table.data_ptr(), block_table.stride(0), seq_lens.data_ptr(), b, num_heads,
        num_kv, head_dim, block_size, head_dim**-0.5 if scale is None else scale,
        _DTYPES[q.dtype], torch.get_num_threads(),
    )
    if rc != 0:
        raise MemoryError("decode_attention: out of memory for its scratch buffers")
    return out
