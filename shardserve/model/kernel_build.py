"""Building the CPU kernel library (native_kernels.py loads it): the C sources, the compiler's
flags, and the cache of built libraries.

Build: `gcc -O3 -fopenmp` and the ISA level's -march (kernel_levels.py) into a cache folder
(SHARDSERVE_CACHE_DIR, default ~/.cache/shardserve), named by a hash of the sources and their
shared headers, the flags, the compiler and the CPU's flags, so an edit, another compiler or
another CPU gets its own library. Each source compiles to an object of its own, as many at
once as the machine has cores, then one link: a fresh build takes about its longest file's
time on as many cores as files, and the first compile error stops the rest (a broken source
fails in its own file's seconds, not the whole build's). The library is linked in a temporary
folder and renamed into place, so a process never loads a half-written file; and one process
builds a library at a time (a lock file beside it), the others wait and load it: the workers
of one engine, or a test suite's processes, starting together on a fresh machine used to
build the same library each.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from shardserve import envs
from shardserve.model import kernel_levels

_CSRC = Path(__file__).parent / "csrc"
SOURCE = _CSRC / "cpu_kernels.c"
# Built into the same library: the matrix products with GGUF-quantized weights (quantization.py).
QUANT_SOURCE = _CSRC / "quant_kernels.c"
# And x's quantization per 32 values (int16, or the opt-in int8) for their integer products.
ACTIVATIONS_SOURCE = _CSRC / "quant_activations.c"
# And their SIMD row kernels for small batches (the batch-1 decode step's products).
ROWS_SOURCE = _CSRC / "quant_rows.c"
# And their AVX2 build's own for Q4_0 / Q4_1 / Q8_0 (integer sums per group of 8 blocks).
ROWS_AVX2_SOURCE = _CSRC / "quant_rows_avx2.c"
# And the rows of R4 / R8 (AVX-512 builds: weights repacked where the tiles do not take them).
ROWS_REPACKED_SOURCE = _CSRC / "quant_rows_repacked.c"
# And the opt-in int8 activations' rows (SHARDSERVE_INT8_ACTIVATIONS).
ROWS_INT8_SOURCE = _CSRC / "quant_rows_int8.c"
# And the 4-bit weights repacked in tiles of 16 rows, with their few-rows product.
TILES_SOURCE = _CSRC / "quant_tiles.c"
# And their AVX2 builds' own for T4 / T8 / T4K (16 rows in two vectors, no reductions).
TILES_AVX2_SOURCE = _CSRC / "quant_tiles_avx2.c"
# And the same for T6K (Q6_K's tiles).
TILES_K6_AVX2_SOURCE = _CSRC / "quant_tiles_k6_avx2.c"
# And the GEMM's panels decoded from those tiles; and the load-time rewrite of blocks as tiles.
TILE_PANELS_SOURCE = _CSRC / "quant_tile_panels.c"
RETILE_SOURCE = _CSRC / "quant_retile.c"
# And the batched products from the quantized blocks (decoded panel by panel, no dense copy).
GEMM_SOURCE = _CSRC / "quant_gemm.c"
# And its int16 tiles on AVX2 builds (vpmaddwd, the sub-block scales folded into the panels).
GEMM_I16_SOURCE = _CSRC / "quant_gemm_i16.c"
# And its panels straight from the tiles (T4 / T8 / T4K / T6K).
GEMM_I16_TILES_SOURCE = _CSRC / "quant_gemm_i16_tiles.c"
# And its bfloat16 products on AMX where the CPU and the kernel allow (Sapphire Rapids on).
GEMM_AMX_SOURCE = _CSRC / "quant_gemm_amx.c"
# And the weight rows it decodes into its panels.
PANEL_SOURCE = _CSRC / "quant_decode.c"
# And a decode step through a stack of quantized layers in one call (fused_decode.py).
DECODE_SOURCE = _CSRC / "decode_layers.c"
# And the LoRA adapters' share of a projection, grouped by adapter slot (model/lora.py).
LORA_SOURCE = _CSRC / "lora_kernels.c"
# And context-parallel attention: partials with log-sum-exp and their merge (context_parallel.py).
CP_SOURCE = _CSRC / "cp_attention.c"
# And decode attention's AVX2 version (the portable and AVX-512 ones live in SOURCE).
ATTENTION_AVX2_SOURCE = _CSRC / "attention_avx2.c"
# Its AVX-512 and portable versions.
ATTENTION_AVX512_SOURCE = _CSRC / "attention_avx512.c"
# And its dispatch: a task per request, or with fewer requests than threads per span of one.
DECODE_ATTENTION_SOURCE = _CSRC / "decode_attention.c"
# Compiled beside the main source (which a test may replace by a copy of its own).
LINKED_SOURCES = (QUANT_SOURCE, ACTIVATIONS_SOURCE, ROWS_SOURCE, ROWS_AVX2_SOURCE,
                  ROWS_REPACKED_SOURCE, ROWS_INT8_SOURCE, TILES_SOURCE, TILES_AVX2_SOURCE,
                  TILES_K6_AVX2_SOURCE, TILE_PANELS_SOURCE,
                  RETILE_SOURCE, GEMM_SOURCE, GEMM_I16_SOURCE, GEMM_I16_TILES_SOURCE,
                  GEMM_AMX_SOURCE, PANEL_SOURCE,
                  DECODE_SOURCE, LORA_SOURCE, CP_SOURCE, ATTENTION_AVX2_SOURCE,
                  ATTENTION_AVX512_SOURCE, DECODE_ATTENTION_SOURCE)
# What the sources share (element types, bfloat16 conversions, cross-file prototypes): hashed with
# them, so an edit to it rebuilds; its folder is on the include path, so a source copied
# elsewhere (the tests' broken copy) still finds it.
HEADER = _CSRC / "kernels_common.h"
# What the quantized-weight sources share among themselves (types, blocks, x's quantized form).
QUANT_HEADER = _CSRC / "quant_blocks.h"
# And the row kernels' tables (which file provides which row kernels).
ROWS_HEADER = _CSRC / "quant_row_tables.h"
# And what decode attention's versions share (loads, a request's scratch, the paged slots).
ATTENTION_HEADER = _CSRC / "attention_common.h"
# No -ffast-math: it would link code that sets flush-to-zero for the whole process. These flags
# allow reordering float sums (vectorised dot products) and nothing else.
FLAGS = (
    "-O3", "-fopenmp", "-shared", "-fPIC", "-fno-math-errno", "-fno-trapping-math",
    "-fassociative-math", "-fno-signed-zeros",
)
BUILD_TIMEOUT_S = 120.0
_POLL_S = 0.02


def build(arch_flags: tuple[str, ...], source: Path, cache_dir: Path | None) -> Path:
    """The cached library of `source` and LINKED_SOURCES built with `arch_flags`, built now if
    missing. Raises RuntimeError with the compiler's output where a compile or the link fails."""
    compiler = shutil.which(envs.compiler())
    if compiler is None:
        raise RuntimeError(f"no C compiler {envs.compiler()!r} on PATH (SHARDSERVE_CC)")
    flags = (*FLAGS, *arch_flags)
    sources = (source, *LINKED_SOURCES)
    cache = Path(cache_dir or envs.cache_dir()) / "kernels"
    target = cache / f"cpu_kernels-{cache_key(compiler, flags, sources)}.so"
    if target.exists():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    with _build_lock(cache / f".{target.stem}.lock"):
        if not target.exists():  # else built while we waited
            _build_into(target, compiler, flags, sources)
    return target


@contextlib.contextmanager
def _build_lock(path: Path) -> Iterator[None]:
    """Hold the library's build lock (released by the kernel if its holder dies); waiting is
    bounded by a build's own bound."""
    deadline = time.monotonic() + BUILD_TIMEOUT_S + 10.0
    with open(path, "w") as f:
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"another process held {path} past the build's "
                                       f"{BUILD_TIMEOUT_S:.0f} s bound") from None
                time.sleep(_POLL_S * 5)
        yield


def _build_into(target: Path, compiler: str, flags: tuple[str, ...],
                sources: tuple[Path, ...]) -> None:
    deadline = time.monotonic() + BUILD_TIMEOUT_S
    with tempfile.TemporaryDirectory(prefix=".build-", dir=target.parent) as tmp:
        folder = Path(tmp)
        objects = [folder / f"{i}-{src.stem}.o" for i, src in enumerate(sources)]
        # -I is not in the key: the headers' bytes are, wherever they lie.
        commands = [[compiler, *flags, f"-I{HEADER.parent}", "-c", str(src), "-o", str(obj)]
                    for src, obj in zip(sources, objects, strict=True)]
        _run_all(commands, folder, deadline)
        linked = folder / "cpu_kernels.so"
        _run_all([[compiler, *flags, *map(str, objects), "-o", str(linked)]], folder, deadline)
        os.replace(linked, target)  # atomic: readers see the whole library or none


def _run_all(commands: list[list[str]], folder: Path, deadline: float) -> None:
    """Run the commands, as many at once as there are cores; the first that fails kills the
    others and raises with its output (kept in files: a pipe could fill and stall it)."""
    jobs = max(1, os.cpu_count() or 1)
    todo = list(enumerate(commands))
    running: dict[subprocess.Popen, int] = {}
    try:
        while todo or running:
            while todo and len(running) < jobs:
                i, cmd = todo.pop(0)
                with open(folder / f"{i}.log", "w") as log:
                    running[subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)] = i
            for proc in [p for p in running if p.poll() is not None]:
                i = running.pop(proc)
                if proc.returncode != 0:
                    output = (folder / f"{i}.log").read_text(errors="replace").strip()
                    raise RuntimeError(f"{' '.join(commands[i])} failed:\n{output}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the kernel build took over {BUILD_TIMEOUT_S:.0f} s")
            if running:
                time.sleep(_POLL_S)
    finally:
        for proc in running:
            proc.kill()
            proc.wait()


def cache_key(compiler: str, flags: tuple[str, ...], sources: tuple[Path, ...]) -> str:
    """What decides a rebuild: the sources and the headers they include, flags, compiler, CPU."""
    source = b"".join(p.read_bytes() for p in (*sources, HEADER, QUANT_HEADER, ROWS_HEADER,
                                                 ATTENTION_HEADER))
    return hashlib.sha256(
        source + " ".join(flags).encode() + _compiler_version(compiler)
        + " ".join(sorted(kernel_levels.cpu_flags())).encode()
    ).hexdigest()[:16]


def _compiler_version(compiler: str) -> bytes:
    out = subprocess.run([compiler, "--version"], capture_output=True, timeout=30)
    return out.stdout
