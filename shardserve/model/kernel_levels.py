"""The instruction-set levels the C kernels are built at, and what a built library reports.

Every level is a separate build of the same sources (native_kernels.py builds and caches each by
its flags), so any machine can build and measure the levels its CPU runs:
- `native`: -march=native, whatever this CPU has (AVX-512 F/BW/VL, VNNI, BF16 where present);
- `avx2`: -march=x86-64-v3 (AVX2, FMA, F16C; no AVX-512): the kernels' AVX2 paths;
- `portable`: -march=x86-64-v2 on x86 (no -march elsewhere): the plain C paths.
SHARDSERVE_ISA (envs.py) picks the level `native_kernels.library()` loads, default native.

What a library was really compiled with is read from the library itself (`kernel_isa()` in
csrc/cpu_kernels.c: one bit per predefined macro, in ISA_BITS's order), not guessed from flags.
"""

from __future__ import annotations

import ctypes
import platform

from shardserve import envs

LEVELS = envs.ISA_LEVELS  # ("native", "avx2", "portable")
X86 = platform.machine() in ("x86_64", "AMD64")
NATIVE_ARCH = ("-march=native",)
AVX2_ARCH = ("-march=x86-64-v3",)
PORTABLE_ARCH = ("-march=x86-64-v2",) if X86 else ()
ARCH_FLAGS = {"native": NATIVE_ARCH, "avx2": AVX2_ARCH, "portable": PORTABLE_ARCH}
# What an avx2 build executes: x86-64-v3 also has BMI1/2, LZCNT, MOVBE, which these CPUs all have.
AVX2_CPU_FLAGS = ("avx2", "fma", "f16c")
# kernel_isa()'s bits, lowest first (the macro each stands for: __AVX2__, __FMA__, ...).
ISA_BITS = ("AVX2", "FMA", "F16C", "AVX512F", "AVX512BW", "AVX512VL", "AVX512VNNI", "AVX512BF16",
            "AMX-BF16")


def cpu_flags() -> set[str]:
    """The `flags` of /proc/cpuinfo (empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((ln for ln in f if ln.startswith("flags")), "")
    except OSError:
        return set()
    return set(line.partition(":")[2].split())


def levels_buildable_here() -> list[str]:
    """The levels this CPU runs: native and portable always, avx2 where /proc/cpuinfo has
    avx2, fma and f16c (on x86-64)."""
    return [level for level in LEVELS if _missing(level) is None]


def _missing(level: str) -> str | None:
    """Why this CPU cannot run `level`, or None."""
    if level != "avx2":
        return None
    if not X86:
        return f"avx2 is an x86-64 level and this machine is {platform.machine()}"
    lacks = [f for f in AVX2_CPU_FLAGS if f not in cpu_flags()]
    return f"this CPU lacks {', '.join(lacks)} (/proc/cpuinfo)" if lacks else None


def arch_flags(level: str) -> tuple[str, ...]:
    """The -march flags of `level`; ValueError for an unknown level or one this CPU lacks."""
    if level not in ARCH_FLAGS:
        raise ValueError(f"unknown ISA level {level!r}: choose one of {', '.join(LEVELS)}")
    why = _missing(level)
    if why is not None:
        raise ValueError(f"ISA level {level!r} cannot run here: {why}; levels this machine "
                         f"runs: {', '.join(levels_buildable_here())} (SHARDSERVE_ISA)")
    return ARCH_FLAGS[level]


def isa_features(lib: ctypes.CDLL) -> list[str]:
    """The instruction sets `lib` was compiled for (ISA_BITS names), from its kernel_isa()."""
    fn = lib.kernel_isa
    fn.restype, fn.argtypes = ctypes.c_int, []
    mask = fn()
    return [name for i, name in enumerate(ISA_BITS) if mask >> i & 1]


def describe(features: list[str]) -> str:
    """e.g. "AVX2, FMA, F16C, AVX-512 F/BW/VL, VNNI, BF16, AMX-BF16"; "plain C (no AVX2)" for
    none."""
    parts = [f for f in features if f in ISA_BITS[:3]]
    base = [f.removeprefix("AVX512") for f in features if f in ISA_BITS[3:6]]
    if base:
        parts.append("AVX-512 " + "/".join(base))
    parts += [f.removeprefix("AVX512") for f in features if f in ISA_BITS[6:8]]
    parts += [f for f in features if f in ISA_BITS[8:]]
    return ", ".join(parts) if parts else "plain C (no AVX2)"


def isa_report(lib: ctypes.CDLL) -> str:
    """What `lib` runs, e.g. "level native (-march=native; AVX2, FMA, F16C, AVX-512 F/BW/VL,
    VNNI, BF16)": its level (by the flags native_kernels.build_library recorded on it) and the
    instruction sets it was compiled for."""
    flags = tuple(getattr(lib, "arch_flags", ()))
    level = next((name for name, f in ARCH_FLAGS.items() if f == flags), "custom")
    return f"level {level} ({' '.join(flags) or 'no -march'}; {describe(isa_features(lib))})"
