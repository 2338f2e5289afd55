"""CPU kernels in C (csrc/cpu_kernels.c), compiled on first use and called through ctypes.

Why C: decode attention over a paged cache is a few small dot products per cached row. Stock
PyTorch has to gather every request's blocks into a padded copy and then run SDPA, whose CPU
kernel is tuned for long query blocks and runs decode shapes at a fraction of its speed. The C
kernel reads K/V rows where they lie, once per step, with float32 accumulation. The small
per-layer ops around it (RMSNorm with the residual add, RoPE, SiLU*up, the KV-cache write) cost
PyTorch 10-70 us each in dispatch and temporaries, 30 layers a step; in C they are one call each.

Build (kernel_build.py): `gcc -O3 -fopenmp -shared` and the ISA level's -march (SHARDSERVE_ISA:
native, avx2, portable; kernel_levels.py; logged once when loaded; compiler: SHARDSERVE_CC), one
object per source in parallel, into a cache folder named by what decides a rebuild. Without a
compiler every caller falls back to the PyTorch path, with one warning;
SHARDSERVE_NATIVE_KERNELS=0 forces that fallback. A compiler that is present but fails
(a broken source, a missing header) also falls back, but logs an error with the compiler's
output: that is a defect, and the tests fail on it (they skip only where `compiler_available()`
is False).

Float16 and non-CPU tensors always take the PyTorch path."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from shardserve import envs
from shardserve.model import kernel_build, kernel_levels

logger = logging.getLogger(__name__)

# The sources, flags and build cache: kernel_build.py (SOURCE a test may replace by a copy).
SOURCE = kernel_build.SOURCE
# The ISA levels' flags (the tests' and the bench's builds) and reports: kernel_levels.py.
NATIVE_ARCH, AVX2_ARCH, PORTABLE_ARCH = (kernel_levels.ARCH_FLAGS[k] for k in kernel_levels.LEVELS)
isa_report, levels_buildable_here = kernel_levels.isa_report, kernel_levels.levels_buildable_here
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_override: ctypes.CDLL | None = None
_wrapper: Callable[[ctypes.CDLL], Any] | None = None  # see wrap_calls


def supports(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the native kernels handle tensors of this dtype on this device."""
    return device.type == "cpu" and dtype in _DTYPES and (_override or library()) is not None


def compiler_available() -> bool:
    """Whether the compiler the build would use (SHARDSERVE_CC, default gcc) is on PATH."""
    return shutil.which(envs.compiler()) is not None


@functools.cache
def library() -> ctypes.CDLL | None:
    """The kernel library built at SHARDSERVE_ISA's level, or None where it is disabled or
    cannot be built. A bad level, or one this CPU lacks, raises ValueError: a setting to fix."""
    if not envs.native_kernels():
        return None
    flags = kernel_levels.arch_flags(envs.isa())
    if not compiler_available():
        logger.warning(
            "native CPU kernels unavailable (no C compiler %r on PATH, SHARDSERVE_CC); "
            "using the PyTorch path", envs.compiler(),
        )
        return None
    try:
        lib = build_library(flags)
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        # The model still runs (PyTorch path), but a compiler that cannot build our own source
        # is a bug to fix, not an environment to accept: hence an error, not a warning.
        logger.error("native CPU kernels failed to build (%s); using the PyTorch path", e)
        return None
    logger.info("native CPU kernels: %s", isa_report(lib))
    if envs.int8_activations():
        lib.quant_set_int8_activations(1)
        logger.warning(
            "SHARDSERVE_INT8_ACTIVATIONS=1: the row kernels take x as int8 per 32 values (faster, "
            "~0.5%% error; greedy outputs may differ from the float model's)%s",
            _tiles_keep_int16(lib))
    if not envs.amx():
        lib.gemm_amx_set(0)
    elif "AMX-BF16" in kernel_levels.isa_features(lib) and not lib.gemm_amx_ready():
        logger.warning("the kernels have AMX-BF16 but this kernel did not grant the tile state "
                       "(arch_prctl ARCH_REQ_XCOMP_PERM): batched bfloat16 products take AVX-512")
    return lib


def _tiles_keep_int16(lib: ctypes.CDLL) -> str:
    """The int8 warning's note on this level's 16-row tiles, which keep int16 x (none with
    SHARDSERVE_TILES=0)."""
    if not envs.tiles():
        return ""
    tiled = [name for name, t in (("Q4_0", 2), ("Q4_1", 3), ("Q8_0", 8), ("Q4_K", 12),
                                  ("Q6_K", 14)) if lib.quant_tile_takes(t)]
    return (f"; this level's 16-row tiles ({', '.join(tiled)} with rows in multiples of 16) "
            "keep int16") if tiled else ""


def build_level(level: str) -> ctypes.CDLL:
    """The kernels built (or cached) at ISA `level` (native, avx2, portable), to run under
    `using`; ValueError for an unknown level or one this CPU lacks (levels_buildable_here())."""
    return build_library(kernel_levels.arch_flags(level))


def build_library(
    arch_flags: tuple[str, ...], *, source: Path | None = None, cache_dir: Path | None = None
) -> ctypes.CDLL:
    """Build (or find in the cache) and load the kernels compiled with `arch_flags`.

    Raises RuntimeError (with the compiler's output) where the build fails. `source` and
    `cache_dir` default to csrc/cpu_kernels.c and SHARDSERVE_CACHE_DIR; tests pass others.
    The other sources (kernel_build.LINKED_SOURCES: the quantized products, the fused decode
    step, LoRA, context-parallel attention) are always compiled in beside `source`."""
    lib = ctypes.CDLL(str(kernel_build.build(arch_flags, source or SOURCE, cache_dir)))
    _declare(lib)
    lib.arch_flags = arch_flags  # isa_report names the level by them
    return lib


@contextlib.contextmanager
def using(lib: ctypes.CDLL) -> Iterator[None]:
    """Run the kernels from `lib` (e.g. the portable build) inside the block."""
    global _override
    previous, _override = _override, lib
    try:
        yield
    finally:
        _override = previous


def _declare(lib: ctypes.CDLL, strict: bool = True) -> None:
    """Argument and result types of lib's entry points; `strict`: each must exist (else an older
    library's, as a benchmark loads one beside this checkout's: those it has)."""
    i64, ptr, f32, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
    signatures = {
        "decode_attention": [ptr, ptr, ptr, i64, ptr, ptr, i64, ptr, i64, i64, i64, i64, i64,
                             f32, i32, i32, i32],
        "rms_norm": [ptr, ptr, i64, ptr, ptr, i64, i64, f32, i32, i32],
        "rope_inplace": [ptr, i64, ptr, ptr, i64, i64, i64, i32, i32],
        "silu_mul": [ptr, ptr, i64, i64, i32, i32],
        "cache_write": [ptr, ptr, i64, ptr, i64, i64, i32, i32],
        "apply_token_bitmask": [ptr, i64, ptr, ptr, i64, i64, i64, i32],
        "quant_matmul": [ptr, i64, i32, ptr, i64, i32, ptr, i64, i32, i64, i64, i64, i32],
        "quant_gemm": [ptr, i64, i32, ptr, i64, i32, ptr, i64, i32, i64, i64, i64, i32],
        "quant_dequantize_rows": [ptr, i32, ptr, i64, i32, ptr, i64, i64, i32],
        "quant_can_repack": [],
        "quant_set_int8_activations": [i32],
        "quant_int8_activations": [],
        "quant_can_tile": [],
        "quant_tile_takes": [i32],
        "quant_gemm_int16": [i32],
        "gemm_amx_ready": [],
        "gemm_amx_set": [i32],
        "quant_retile": [i32, ptr, i64, ptr, i64, i64],
        "decode_layers": [ptr, i64, ptr],
        "lora_add": [ptr, i64, i32, ptr, i64, ptr, i64, ptr, ptr, i32, i64, i64, i64, i64, ptr,
                     i64, i32],
        "cp_partial_attention": [ptr, ptr, ptr, i64, ptr, ptr, i64, ptr, ptr, i64, i64, i64,
                                 i64, i64, f32, i32, i64, i64, i64, i32],
        "cp_merge": [ptr, ptr, ptr, i64, i64, i64, i32],
    }
    for name, argtypes in signatures.items():
        if not strict and not hasattr(lib, name):
            continue
        fn = getattr(lib, name)
        fn.restype = i32
        fn.argtypes = argtypes


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
    contiguous, in q's dtype or bfloat16 under float32 q (kv_cache_dtype="bfloat16").
    block_table: int64 [B, W] contiguous rows; seq_lens: int64 [B], context lengths including
    this step's token, whose K/V must already be in the cache.
    """
    lib = _lib()
    _, num_heads, head_dim = q.shape
    num_blocks, block_size, two, num_kv, kv_dim = kv_cache.shape
    b = block_table.shape[0]
    if q.stride(2) != 1 or q.stride(1) != head_dim or not kv_cache.is_contiguous():
        raise ValueError("decode_attention needs unit-stride query rows and a contiguous cache")
    if two != 2 or kv_dim != head_dim or num_heads % num_kv or \
            not kv_dtype_ok(q.dtype, kv_cache.dtype):
        raise ValueError(f"shape/dtype mismatch: q {tuple(q.shape)} {q.dtype}, "
                         f"cache {tuple(kv_cache.shape)} {kv_cache.dtype}")
    _check_int64(block_table=block_table, seq_lens=seq_lens, q_rows=q_rows)
    block_table = block_table.contiguous()
    q_rows = None if q_rows is None else q_rows.contiguous()
    seq_lens = seq_lens.contiguous()
    out = torch.empty(b, num_heads * head_dim, dtype=q.dtype)
    rc = lib.decode_attention(
        out.data_ptr(), q.data_ptr(), _ptr(q_rows), q.stride(0), kv_cache.data_ptr(),
        block_table.data_ptr(), block_table.stride(0), seq_lens.data_ptr(), b, num_heads,
        num_kv, head_dim, block_size, head_dim**-0.5 if scale is None else scale,
        _DTYPES[q.dtype], _DTYPES[kv_cache.dtype], torch.get_num_threads(),
    )
    _check(rc, "decode_attention")
    return out


def kv_dtype_ok(act_dtype: torch.dtype, kv_dtype: torch.dtype) -> bool:
    """The cache in the activations' dtype, or bfloat16 under float32: the pairs the kernels
    (decode_attention, cache_write, the fused decode step) take."""
    return kv_dtype == act_dtype or (act_dtype == torch.float32 and kv_dtype == torch.bfloat16)


def _check_int64(**indices: torch.Tensor | None) -> None:
    """The C side reads these as int64 arrays: anything else would be misread, not converted."""
    for name, t in indices.items():
        if t is not None and (t.dtype != torch.int64 or t.device.type != "cpu"):
            raise ValueError(f"{name} must be an int64 CPU tensor, got {t.dtype} on {t.device}")


def _check(rc: int, name: str) -> None:
    if rc != 0:
        raise MemoryError(f"{name}: out of memory for its scratch buffers")


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """HF-style RMSNorm of x [T, N] (rows may be strided); with a residual [T, N] (contiguous),
    first residual += x in place and normalise that. Returns a new [T, N] tensor."""
    lib = _lib()
    t, n = x.shape
    if x.stride(1) != 1 or (residual is not None and not residual.is_contiguous()):
        raise ValueError("rms_norm needs unit-stride rows and a contiguous residual")
    out = torch.empty(t, n, dtype=x.dtype)
    rc = lib.rms_norm(
        out.data_ptr(), x.data_ptr(), x.stride(0), _ptr(residual), weight.data_ptr(), t, n, eps,
        _DTYPES[x.dtype], torch.get_num_threads(),
    )
    _check(rc, "rms_norm")
    return out


def rope_(x: torch.Tensor, positions: torch.Tensor, table: torch.Tensor) -> None:
    """Rotate x [T, heads, D] (interleaved pairs; rows may be strided) in place by the complex64
    table [P, D/2] rows at `positions` (int64 [T], all < P)."""
    lib = _lib()
    t, heads, d = x.shape
    if x.stride(2) != 1 or x.stride(1) != d or not table.is_contiguous():
        raise ValueError("rope_ needs unit-stride heads and a contiguous table")
    _check_int64(positions=positions)
    positions = positions.contiguous()
    rc = lib.rope_inplace(
        x.data_ptr(), x.stride(0), positions.data_ptr(), table.data_ptr(), t, heads, d,
        _DTYPES[x.dtype], torch.get_num_threads(),
    )
    _check(rc, "rope_inplace")


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for a contiguous [T, 2 * I] gate_up (gate first); returns [T, I]."""
    lib = _lib()
    if not gate_up.is_contiguous():
        raise ValueError("silu_mul needs a contiguous gate_up")
    t, two_i = gate_up.shape
    out = torch.empty(t, two_i // 2, dtype=gate_up.dtype)
    rc = lib.silu_mul(out.data_ptr(), gate_up.data_ptr(), t, two_i // 2, _DTYPES[gate_up.dtype],
                      torch.get_num_threads())
    _check(rc, "silu_mul")
    return out


def cache_write(kv_cache: torch.Tensor, kv: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """kv_cache.view(slots, -1)[slot_mapping] = kv, for kv [T, 2, Hkv, D] whose rows are dense
    (a view into qkv is fine) and a contiguous cache [num_blocks, block_size, 2, Hkv, D] in kv's
    dtype (or bfloat16 under float32 kv: the rows rounded to nearest even)."""
    lib = _lib()
    t, slot_elems = kv.shape[0], kv[0].numel()
    if (
        not kv_cache.is_contiguous()
        or not kv[0].is_contiguous()
        or not kv_dtype_ok(kv.dtype, kv_cache.dtype)
        or kv_cache[0, 0].numel() != slot_elems
    ):
        raise ValueError("cache_write needs a contiguous cache, dense kv rows of one slot's size "
                         f"and the cache in kv's dtype or bfloat16 (kv {kv.dtype}, cache "
                         f"{kv_cache.dtype})")
    _check_int64(slot_mapping=slot_mapping)
    slot_mapping = slot_mapping.contiguous()
    rc = lib.cache_write(kv_cache.data_ptr(), kv.data_ptr(), kv.stride(0), slot_mapping.data_ptr(),
                         t, slot_elems, _DTYPES[kv.dtype], _DTYPES[kv_cache.dtype])
    _check(rc, "cache_write")


def apply_token_bitmask_(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor
                         ) -> None:
    """In place: logits[rows[r], t] = -inf where bit t of bitmask row r is clear (float32
    [B, V] logits with unit column stride, int64 rows, int32 [R, ceil(V / 32)] bitmask)."""
    lib = _lib()
    if logits.dtype != torch.float32 or logits.stride(-1) != 1 or bitmask.dtype != torch.int32:
        raise ValueError("apply_token_bitmask_ needs float32 logits with unit column stride and "
                         "an int32 bitmask")
    _check_int64(rows=rows)
    rows, bitmask = rows.contiguous(), bitmask.contiguous()
    v = logits.shape[-1]
    if bitmask.shape != (rows.numel(), -(-v // 32)):
        raise ValueError(f"bitmask shape {tuple(bitmask.shape)} does not fit {rows.numel()} "
                         f"rows of {v} tokens")
    rc = lib.apply_token_bitmask(logits.data_ptr(), logits.stride(0), rows.data_ptr(),
                                 bitmask.data_ptr(), rows.numel(), bitmask.shape[1], v,
                                 torch.get_num_threads())
    _check(rc, "apply_token_bitmask")


def lora_add_(out: torch.Tensor, x: torch.Tensor, slots: torch.Tensor, at: torch.Tensor,
              bt: torch.Tensor, seg_ends: torch.Tensor) -> None:
    """In place: out[t] += bt[s].T @ (at[s].T @ x[t]) for every token t whose slot s = slots[t]
    is >= 0 (csrc/lora_kernels.c). out [T, N] and x [T, K] with unit column stride, slots int32
    [T], at [S, K, R] (A transposed) and bt [S, R, N] (B transposed) contiguous, seg_ends int64
    [nseg]: the merged parts' output boundaries (part j takes rows j R/nseg .. of bt)."""
    t, n = out.shape
    s, k, r = at.shape
    if out.stride(1) != 1 or x.stride(1) != 1 or x.shape != (t, k) or \
            not (at.is_contiguous() and bt.is_contiguous()) or bt.shape != (s, r, n) or \
            slots.dtype != torch.int32 or at.dtype != bt.dtype or out.dtype != x.dtype:
        raise ValueError(f"lora_add_: out {tuple(out.shape)} {out.dtype}, x {tuple(x.shape)} "
                         f"{x.dtype}, at {tuple(at.shape)} {at.dtype}, bt {tuple(bt.shape)}, "
                         f"slots {slots.dtype} do not fit")
    _check_int64(seg_ends=seg_ends)
    slots, seg_ends = slots.contiguous(), seg_ends.contiguous()
    rc = _lib().lora_add(out.data_ptr(), out.stride(0), _DTYPES[out.dtype], x.data_ptr(),
                         x.stride(0), slots.data_ptr(), t, at.data_ptr(), bt.data_ptr(),
                         _DTYPES[at.dtype], s, r, k, n, seg_ends.data_ptr(), seg_ends.numel(),
                         torch.get_num_threads())
    if rc == -2:
        raise ValueError(f"lora_add_: segments {seg_ends.tolist()} do not split {n} outputs "
                         f"and {r} ranks evenly")
    _check(rc, "lora_add")


def lib() -> ctypes.CDLL:
    """The loaded kernel library (the override inside `using`); RuntimeError without one.
    Callers with their own wrappers: fused_decode.py, context_parallel.py."""
    return _lib()


def wrap_calls(wrapper: Callable[[ctypes.CDLL], Any] | None) -> None:
    """Hand every caller `wrapper(library)` instead of the library until called with None:
    the profiler's view, whose functions record a range per call (worker/profiler.py). Every
    kernel call looks the library up when it runs, so this reaches all of them."""
    global _wrapper
    _wrapper = wrapper


def _lib() -> ctypes.CDLL:
    lib = _override or library()
    if lib is None:
        raise RuntimeError("native CPU kernels are not available (see supports())")
    return lib if _wrapper is None else _wrapper(lib)
