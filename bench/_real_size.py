"""The real-size table of bench/cpu_vs_llamacpp.py (with --llama-bin): shardserve's sides and
llama.cpp's own binaries on one GGUF, every side a fresh process per round.

Each round measures, back to back: the machine's read bandwidth (bench/_llamacpp_bin.py) and
multiply-add ceiling (bench/_compute_floor.py), then every side (the order rotating per round):
its measurements (bench/_shardserve_side.py; llama-bench and llama-batched-bench), a bare
`python -c "import torch"` (spawn to exit) and its cold start. Ratios are taken within a round
and reported as the median over rounds.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from _compute_floor import (
    add_ceilings,
    build_floor,
    floor_gmacs,
    report_compute,
    weight_macs_per_token,
)
from _llamacpp_bin import (
    COLD_CTX,
    LlamaBinSide,
    import_torch_s,
    read_bandwidth_gbs,
    run_child,
    weight_bytes_per_token,
)
from _rounds import Rounds, median_or_nan, rotated, spread
from _shardserve_side import kv_bytes

LLAMA = "llama.cpp"
MACHINE = "machine"
# Columns where lower is better (ratios still shardserve / llama.cpp).
RSS, PEAK, LOAD, COLD, COLD_NET = "RSS MB", "peak MB", "load s", "cold s", "cold-torch"


def first_line_time(cmd: list[str], marker: str, env: dict[str, str] | None = None) -> float:
    """Seconds from spawning cmd to the first stdout line containing marker."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env={**os.environ, **(env or {})})
    assert proc.stdout is not None
    try:
        for line in proc.stdout:
            if marker in line:
                return time.perf_counter() - t0
        raise RuntimeError(f"{cmd[:4]}... exited ({proc.wait()}) without printing {marker!r}")
    finally:
        proc.kill()
        proc.wait()


def shardserve_cold_start(model: str, options: dict, env: dict[str, str],
                          extra: tuple[str, ...] = ()) -> float:
    """`shardserve generate "Hi" --max-tokens 1` with the side's flags: spawn to first output."""
    script = Path(sys.executable).with_name("shardserve")
    base = [str(script)] if script.exists() else [sys.executable, "-m", "shardserve"]
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in options.items()]
    return first_line_time([*base, "generate", "Hi", "--max-tokens", "1", "--model", model,
                            *flags, *extra], "--- output 1", env)


class ShardserveRealSide:
    """One shardserve side; bench/_shardserve_side.py in a fresh process per round."""

    def __init__(self, name: str, model: str, options: dict, env: dict[str, str],
                 shape: dict) -> None:
        self.name, self.model, self.options, self.env, self.shape = name, model, options, env, shape

    def measure(self) -> dict:
        here = Path(__file__).with_name("_shardserve_side.py")
        cfg = {"model": self.model, "options": self.options, **self.shape}
        out, _, _, _ = run_child([sys.executable, str(here), json.dumps(cfg)], self.env)
        return json.loads(out.strip().splitlines()[-1])

    def cold_start(self) -> float:
        # A context of COLD_CTX tokens, as llama.cpp's cold start gets (not 10% of the RAM for
        # the KV cache, which the engine would zero first).
        kv = kv_bytes(self.model, self.options.get("dtype", "auto"), COLD_CTX + 64)
        return shardserve_cold_start(self.model, self.options, self.env, (
            "--max-model-len", str(COLD_CTX), "--kv-cache-memory-bytes", str(kv)))

    def close(self) -> None:
        pass


def columns(shape: dict) -> list[str]:
    return [RSS, PEAK, LOAD, COLD, COLD_NET, f"pp{shape['pp']}", f"tg{shape['tg']}",
            *(f"B={b}" for b in shape["batches"])]


def measure_round(sides: list, r: int, shape: dict, threads: int, samples: Rounds,
                  floor: dict[str, Path] | None, kinds: dict[str, str]) -> None:
    samples.add((MACHINE, "GB/s"), read_bandwidth_gbs(threads))
    if floor is not None:
        kinds.update(add_ceilings(samples, MACHINE, floor_gmacs(floor, threads)))
    cols = columns(shape)
    for side in rotated(sides, r):
        got = side.measure()
        torch_s = import_torch_s()  # right before each cold start: this machine drifts
        samples.add((MACHINE, "import torch s"), torch_s)
        cold = side.cold_start()
        decode = [got["decode"].get(str(b), float("nan")) for b in shape["batches"]]
        net = cold if side.name == LLAMA else cold - torch_s  # llama.cpp imports no torch
        values = [got["rss_mb"], got["peak_mb"], got["load_s"], cold, net,
                  got["pp"], got["tg"], *decode]
        for col, value in zip(cols, values, strict=True):
            samples.add((side.name, col), value)
        print(f"  {side.name}: " + json.dumps({k: v for k, v in got.items() if k != "decode"}
                                               | {"decode": got["decode"], "cold_s": cold}),
              flush=True)


def report(samples: Rounds, names: list[str], shape: dict, bytes_per_token: int,
           rounds: int) -> None:
    cols = columns(shape)
    has_llama = LLAMA in names
    print("\nmedians over rounds (tok/s unless marked; RSS: after load (llama.cpp: its peak); "
          "cold-torch = cold s minus a bare `import torch` just before it; llama.cpp's: cold s)")
    print(f"{'side':<14}" + "".join(f"{c:>11}" for c in cols))
    for name in names:
        print(f"{name:<14}" + "".join(f"{samples.median((name, c)):>11.2f}" for c in cols))
    if has_llama:
        print("\nshardserve / llama.cpp, median of per-round ratios (RSS, load, cold: lower is "
              "better)")
        for name in names:
            if name == LLAMA:
                continue
            cells = [samples.ratio((name, c), (LLAMA, c)) for c in cols]
            print(f"{name:<14}" + "".join(f"{x:>10.2f}x" for x in cells))
            if rounds > 1:
                ranges = [spread(samples.ratios((name, c), (LLAMA, c))) for c in cols]
                print(f"{'  range':<14}" + "".join(f" {x:>10}" for x in ranges))
    b1 = f"B={shape['batches'][0]}"
    tg = f"tg{shape['tg']}"
    # The acceptance's batch-1 figure, and its 64 x 128 one (the widest batch over llama.cpp's
    # sequential rate): llama.cpp's is its llama-bench tg.
    widest = f"B={shape['batches'][-1]}"
    if has_llama:
        for name in (n for n in names if n != LLAMA):
            for col in dict.fromkeys((b1, widest)):
                per = samples.ratios((name, col), (LLAMA, tg))
                print(f"{name:<14}{col} over llama.cpp's {tg}: {median_or_nan(per):.2f}x "
                      f"({spread(per)})")
    bw = samples.values((MACHINE, "GB/s"))
    bounds = [g * 1e9 / bytes_per_token for g in bw]
    print(f"\nbatch 1: {bytes_per_token / 1e6:.1f} MB of weights read per token (file tensors, "
          f"one embedding row); read bandwidth {median_or_nan(bw):.1f} GB/s ({spread(bw, '.1f')})"
          f" -> bound {median_or_nan(bounds):.1f} tok/s; bare import torch "
          f"{samples.median((MACHINE, 'import torch s')):.2f} s")
    for name in names:
        for col in (b1, tg):
            shares = [v / b for v, b in zip(samples.values((name, col)), bounds, strict=False)]
            print(f"  {name:<14} {col:>6}: {100 * median_or_nan(shares):5.1f}% of the bound")


def require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        sys.exit("--plot needs matplotlib, which `make install` leaves out: "
                 ".venv/bin/pip install matplotlib==3.11.2 (or drop --plot)")


def plot(samples: Rounds, names: list[str], shape: dict, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = shape["batches"]
    fig, ax = plt.subplots(figsize=(6, 4))
    for name in names:
        ys = [samples.median((name, f"B={b}")) for b in batches]
        ax.plot(batches, ys, marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xticks(batches, [str(b) for b in batches])
    ax.set_xlabel("batch size (sequences decoding together)")
    ax.set_ylabel("decode tok/s")
    ax.set_title(title, fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot written to {path}")


def run_real(args, sides_options: dict, side_env: dict, model: str) -> None:
    """The whole real-size benchmark for parsed args (bench/cpu_vs_llamacpp.py)."""
    if args.plot:
        require_matplotlib()  # before the rounds, not after them
    shape = {"batches": [int(b) for b in args.batches.split(",")], "npp": args.npp,
             "ntg": args.ntg, "pp": args.pp, "tg": args.tg}
    env = {"SHARDSERVE_ISA": args.isa, "SHARDSERVE_NUM_THREADS": str(args.threads)}
    sides: list = [ShardserveRealSide(n, model, sides_options[n], {**env, **side_env.get(n, {})},
                                      shape) for n in args.sides.split(",")]
    bin_dir = Path(args.llama_bin or ".") / f"bin-{args.isa}"
    if args.llama_bin and bin_dir.is_dir():
        sides.append(LlamaBinSide(bin_dir, model, args.threads, args.pp, args.tg, args.npp,
                                  args.ntg, shape["batches"], args.llama_bench_reps))
    else:
        print(f"llama.cpp side skipped: no --llama-bin DIR with bin-{args.isa} in it "
              f"(../shared/bench/build_llama_cpp.sh DIR native|avx2)")
    bytes_per_token = weight_bytes_per_token(model)
    floor = build_floor(args.isa)
    samples, kinds = Rounds(), {}
    # Warm-up: torch's and the kernels' files in the page cache, the kernels built for this
    # ISA, the model file read once.
    import_torch_s()
    read_bandwidth_gbs(args.threads)
    for side in sides:
        if isinstance(side, ShardserveRealSide):
            side.cold_start()
    for r in range(args.rounds):
        measure_round(sides, r, shape, args.threads, samples, floor, kinds)
        print(f"round {r + 1}/{args.rounds} done", flush=True)
    names = [s.name for s in sides]
    report(samples, names, shape, bytes_per_token, args.rounds)
    if kinds:
        report_compute(samples, MACHINE, kinds, names, shape["batches"],
                       weight_macs_per_token(model), LLAMA, args.isa, args.threads)
    else:
        print(f"\nno multiply-add ceiling: no gcc, or no loops at --isa {args.isa}")
    if args.plot:
        plot(samples, names, shape, args.plot,
             f"{Path(model).name}, {args.threads} threads, ISA {args.isa}")
