"""The batched quantized product (csrc/quant_gemm.c) of this checkout beside an older build of
the kernel library, in one process, calls alternating round by round (the VM's drift hits both).

    python bench/quant_gemm_ab.py --old-lib ~/.cache/shardserve/kernels/cpu_kernels-HASH.so \
        [--shapes 512x2048x8192,32x2048x8192] [--types 12,14] [--rounds 5] [--dtype bfloat16] \
        [--product rows --distinct 6] [--tiled]

OLD-LIB: the library an older checkout built (its `native_kernels.library()._name`). Shapes are
B x K x N (rows of x, input size, output size); weights are random blocks of each GGML type
(12 Q4_K, 14 Q6_K, 3 Q4_1, ...). Prints GMAC/s of both, the median of per-round ratios, their
largest relative difference and, at 32 rows or fewer, the row kernels' GMAC/s (which take those
batches in the engine below quant_rows_max.rows_max).
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "model"))
from test_quantization import random_blocks  # noqa: E402

from shardserve import envs  # noqa: E402
from shardserve.model import native_kernels as nk  # noqa: E402
from shardserve.model import quantization as q  # noqa: E402


def _timed(product, out: torch.Tensor, x: torch.Tensor, ws: list[q.QuantizedTensor]) -> float:
    product(out, x, ws[0])  # warm: the scratch and the pages of out
    start = time.perf_counter()
    for w in ws:
        product(out, x, w)
    return (time.perf_counter() - start) / len(ws)


def compare(old: ctypes.CDLL, new: ctypes.CDLL, shape: tuple[int, int, int], ggml_type: int,
            args: argparse.Namespace) -> str:
    b, k, n = shape
    dtype, rounds = getattr(torch, args.dtype), args.rounds
    ws = [random_blocks(ggml_type, n, k, seed=1 + i) for i in range(args.distinct)]
    if args.tiled:  # as the loader lays them out where this build tiles (AVX-512): T4K, T6K, ...
        with nk.using(new):
            ws = [q.repack(w) for w in ws]
    x = torch.randn(b, k).to(dtype)
    product = q.matmul_into if args.product == "rows" else q.gemm_into
    times: dict[str, list[float]] = {"old": [], "new": []}
    outs = {}
    for _ in range(rounds):
        for name, lib in (("old", old), ("new", new)):
            with nk.using(lib):
                outs[name] = torch.empty(b, n, dtype=dtype)
                times[name].append(_timed(product, outs[name], x, ws))
    ratio = statistics.median(o / m for o, m in zip(times["old"], times["new"], strict=True))
    old_out, new_out = outs["old"].float(), outs["new"].float()
    diff = ((old_out - new_out).abs().max() / old_out.abs().max()).item()
    rate = {name: b * k * n / statistics.median(ts) / 1e9 for name, ts in times.items()}
    line = (f"{b}x{k}x{n} type {ggml_type}: old {rate['old']:.1f}, new {rate['new']:.1f} "
            f"GMAC/s, new/old {ratio:.2f}x, rel diff {diff:.1e}")
    if b <= 32 and args.product == "gemm":
        with nk.using(new):
            row = [_timed(q.matmul_into, torch.empty(b, n, dtype=dtype), x, ws)
                   for _ in range(rounds)]
        line += f"; rows {b * k * n / statistics.median(row) / 1e9:.1f} GMAC/s"
    return line


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old-lib", required=True, type=Path)
    parser.add_argument("--shapes", default="512x2048x8192,32x2048x8192,16x2048x8192,"
                        "512x8192x2048")
    parser.add_argument("--types", default="12,14")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--product", choices=("gemm", "rows"), default="gemm",
                        help="rows: the row kernels (quantization.matmul_into: decode steps)")
    parser.add_argument("--distinct", type=int, default=1,
                        help="weights per shape, each call cycling through them (6 at Q4_K's 1B "
                        "FFN shape outgrow the caches: products from memory, as decode's)")
    parser.add_argument("--tiled", action="store_true",
                        help="weights repacked as the loader does on this build (tiles of 16 "
                        "rows on AVX-512)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="x's dtype (bfloat16: vdpbf16ps panels where the CPU has them)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    old = ctypes.CDLL(str(args.old_lib.expanduser()))
    nk._declare(old, strict=False)
    if envs.int8_activations():  # the old library in the mode the new one loaded in
        old.quant_set_int8_activations(1)
    new = nk.library()
    if new is None:
        sys.exit("this checkout's kernels did not build (see the log above)")
    print(f"old {args.old_lib}, new {new._name}, {args.threads} threads")
    for shape in args.shapes.split(","):
        dims = tuple(int(d) for d in shape.split("x"))
        for ggml_type in (int(t) for t in args.types.split(",")):
            print(compare(old, new, dims, ggml_type, args), flush=True)


if __name__ == "__main__":
    main()
