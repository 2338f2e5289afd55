"""The row kernels with int8 activations (SHARDSERVE_INT8_ACTIVATIONS, csrc/quant_rows_int8.c)
beside the default int16 ones, in one process, calls alternating round by round.

    python bench/int8_rows.py [--isa avx2] [--types 12,14,8] [--rounds 5] \
        [--shapes 1x2048x8192,1x8192x2048,4x2048x8192]

Shapes are B x K x N (rows of x, input size, output size); each round multiplies x with 6
distinct random weights of that shape (from memory: 6 x 9.4 MB at Q4_K's 1B FFN shape), int16
then int8. Prints both times, the int8 rows' GB/s of weight bytes, the median of per-round
speed-ups, and each mode's error against the float64 product (the price of int8).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "model"))
from test_quantization import random_blocks, reference, rel_err  # noqa: E402

from shardserve.model import native_kernels as nk  # noqa: E402
from shardserve.model import quantization as q  # noqa: E402


def _round(lib, x: torch.Tensor, ws: list[q.QuantizedTensor],
           mode: int) -> tuple[float, torch.Tensor]:
    lib.quant_set_int8_activations(mode)
    out = torch.empty(x.shape[0], ws[0].shape[0])
    q.matmul_into(out, x, ws[0])  # warm, and the result kept
    first = out.clone()
    start = time.perf_counter()
    for w in ws:
        q.matmul_into(out, x, w)
    return (time.perf_counter() - start) / len(ws), first


def compare(lib, shape: tuple[int, int, int], ggml_type: int, rounds: int) -> str:
    b, k, n = shape
    ws = [random_blocks(ggml_type, n, k, seed=s) for s in range(6)]
    x = torch.randn(b, k, generator=torch.Generator().manual_seed(0))
    want = x.double() @ reference(ws[0]).double().T
    times: dict[int, list[float]] = {0: [], 1: []}
    errs = {}
    with nk.using(lib):
        try:
            for _ in range(rounds):
                for mode in (0, 1):
                    t, out = _round(lib, x, ws, mode)
                    times[mode].append(t)
                    errs[mode] = rel_err(out, want)
        finally:
            lib.quant_set_int8_activations(0)
    speedup = statistics.median(a / c for a, c in zip(times[0], times[1], strict=True))
    t16, t8 = statistics.median(times[0]), statistics.median(times[1])
    return (f"type {ggml_type} {b}x{k}x{n}: int16 {t16 * 1e3:.2f} ms, int8 {t8 * 1e3:.2f} ms "
            f"({ws[0].data.numel() / t8 / 1e9:.1f} GB/s), int8 {speedup:.2f}x; error of the "
            f"largest output: int16 {errs[0]:.1e}, int8 {errs[1]:.1e}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--isa", default="avx2", choices=["native", "avx2", "portable"])
    ap.add_argument("--types", default="12,14,8")
    ap.add_argument("--shapes", default="1x2048x8192,1x8192x2048,4x2048x8192")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lib = nk.build_level(args.isa)
    print(f"{nk.isa_report(lib)}, {args.threads} threads, {args.rounds} rounds")
    for t in (int(v) for v in args.types.split(",")):
        for shape in args.shapes.split(","):
            b, k, n = (int(v) for v in shape.split("x"))
            print(compare(lib, (b, k, n), t, args.rounds), flush=True)


if __name__ == "__main__":
    main()
