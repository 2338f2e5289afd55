"""The multiply-add ceiling of batched decode on this CPU, measured beside bench/_real_size.py's
table: bench/csrc/int8_gemm_floor.c's inner loops (from L1/L2: no weight decode, no memory
traffic), built at the bench's --isa and run at its threads once a round, before the sides.

A batched decode step does one multiply-add per weight and sequence (the file's matrices;
attention's products on the KV cache are left out: about 1% of them at these contexts), so

    GMAC/s = decode tok/s x multiply-adds per token / 1e9

and a decode rate whose GMAC/s is above a loop's is out of reach of every kernel built on that
loop. The report gives each side's batched figures as a share of the fastest loop with a float
step (per 32 or 256 columns, as the quantized kernels have) and of the fastest int16 one (the
AVX2 GEMM's, quant_gemm_i16.c), per round, and what 2x llama.cpp's figure at each batch would
need of them: the floor behind a batched target that is not met.
"""

from __future__ import annotations

import atexit
import shutil
import subprocess
import tempfile
from pathlib import Path

from _rounds import Rounds, median_or_nan, spread

SOURCE = Path(__file__).with_name("csrc") / "int8_gemm_floor.c"
MARCH = {"native": "native", "avx2": "x86-64-v3"}  # --isa -> gcc -march (portable: no loops)
SCALED = ("-32", "-256")  # the loops with a float step: what a quantized kernel runs
CEILING, CEILING_I16 = "ceiling GMAC/s", "int16 ceiling GMAC/s"
UNROLLED = "-unrolled4"  # the tag of the -DFLOOR_UNROLL build's binary and kinds


def build_floor(isa: str) -> dict[str, Path] | None:
    """The loops' binaries at the --isa level, as written and with every inner loop unrolled 4
    times (-DFLOOR_UNROLL: the engine's micro-kernels are; gcc leaves them rolled at -O3, and
    either build can be the faster by 1.3x depending on the loop), or None where there is no
    such level or no gcc. Keyed by the tag each build's kinds carry ("" and UNROLLED)."""
    march = MARCH.get(isa)
    if march is None or shutil.which("gcc") is None:
        return None
    folder = tempfile.mkdtemp(prefix="shardserve-floor-")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    binaries = {}
    for tag, flags in (("", []), (UNROLLED, ["-DFLOOR_UNROLL"])):
        binary = Path(folder) / f"int8_gemm_floor-{isa}{tag}"
        subprocess.run(["gcc", "-O3", f"-march={march}", "-fopenmp", *flags, str(SOURCE),
                        "-o", str(binary)], check=True, capture_output=True, text=True,
                       timeout=300)
        binaries[tag] = binary
    return binaries


def floor_gmacs(binaries: dict[str, Path], threads: int) -> dict[str, float]:
    """GMAC/s of each scaled loop at `threads` threads, from each build (its lines: `name rate
    GMAC/s ...`), each kind's name followed by its build's tag."""
    rates = {}
    for tag, binary in binaries.items():
        out = subprocess.run([str(binary), str(threads)], capture_output=True, text=True,
                             check=True, timeout=600)
        for line in out.stdout.splitlines():
            name, rate, *_ = line.split()
            if name.endswith(SCALED):
                rates[name + tag] = float(rate)
    return rates


def add_ceilings(samples: Rounds, machine: str, rates: dict[str, float]) -> dict[str, str]:
    """One round's ceilings into samples; returns the kinds that set them (for the report)."""
    best = max(rates, key=rates.__getitem__)
    best_i16 = max((k for k in rates if k.startswith("i16")), key=rates.__getitem__)
    samples.add((machine, CEILING), rates[best])
    samples.add((machine, CEILING_I16), rates[best_i16])
    return {CEILING: best, CEILING_I16: best_i16}


def weight_macs_per_token(model: str) -> int:
    """Multiply-adds of one decode token through the file's matrices: every tensor of two or
    more dimensions but the token embedding (a row gathered), which counts whole where the file
    has no output.weight (then it is the LM head too)."""
    import numpy as np

    from shardserve.model.gguf_loader import read_gguf

    gf, _ = read_gguf(Path(model))
    names = {t.name for t in gf.tensors}
    total = 0
    for t in gf.tensors:
        if len(t.shape) < 2 or (t.name == "token_embd.weight" and "output.weight" in names):
            continue
        total += int(np.prod(t.shape, dtype=np.int64))
    return total


def _shares(samples: Rounds, key: tuple, ceilings: list[float], macs: int,
            scale: float = 1.0) -> list[float]:
    return [scale * v * macs / 1e9 / c
            for v, c in zip(samples.values(key), ceilings, strict=False)]


def report_compute(samples: Rounds, machine: str, kinds: dict[str, str], names: list[str],
                   batches: list[int], macs: int, llama: str, isa: str, threads: int) -> None:
    best, i16 = samples.values((machine, CEILING)), samples.values((machine, CEILING_I16))
    print(f"\nbatched decode against the multiply-add ceiling: {macs / 1e6:.1f} M multiply-adds "
          f"per token (the file's matrices; attention left out); bench/csrc/int8_gemm_floor.c "
          f"at -march={MARCH[isa]}, {threads} threads, from L1/L2: fastest scaled loop "
          f"{kinds[CEILING]} {median_or_nan(best):.1f} GMAC/s ({spread(best, '.1f')}), "
          f"fastest int16 {kinds[CEILING_I16]} {median_or_nan(i16):.1f} ({spread(i16, '.1f')})"
          f" -> at most {median_or_nan(best) * 1e9 / macs:.1f} / "
          f"{median_or_nan(i16) * 1e9 / macs:.1f} tok/s at any batch size")
    cols = [f"B={b}" for b in batches if b > 1]
    for name in names:
        for col in cols:
            gmacs = [v * macs / 1e9 for v in samples.values((name, col))]
            of_best = median_or_nan(_shares(samples, (name, col), best, macs))
            of_i16 = median_or_nan(_shares(samples, (name, col), i16, macs))
            print(f"  {name:<14} {col:>6}: {median_or_nan(gmacs):6.1f} GMAC/s, "
                  f"{100 * of_best:5.1f}% of the fastest loop, {100 * of_i16:5.1f}% of the "
                  f"int16 one")
    if llama in names:
        for col in cols:
            need = _shares(samples, (llama, col), best, macs, 2.0)
            need16 = _shares(samples, (llama, col), i16, macs, 2.0)
            print(f"  2x {llama}'s {col} would need {100 * median_or_nan(need):5.1f}% of the "
                  f"fastest loop ({spread([100 * x for x in need], '.0f')}), "
                  f"{100 * median_or_nan(need16):5.1f}% of the int16 one")
