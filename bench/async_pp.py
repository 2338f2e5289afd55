"""Asynchronous scheduling against synchronous, per backend and batch size; and tensor against
pipeline parallelism; in one run.

    python bench/async_pp.py [--rounds 3] [--tokens 64] [--batches 1,32] [--dtype auto]
                             [--parallel-batch 64] [--no-async-table] [--no-parallel-table]

Engines (all up at once, default model): uni and mp (TP=1, one worker process), each with
async_scheduling off and on. Each round runs every (engine, batch) cell once, in turn, so the
machine's drift hits every cell alike: `batch` prompts x --tokens new tokens (EOS ignored),
after one untimed warm-up generation per engine.

Parallelism table (--parallel-batch prompts, mp, async scheduling on): TP=1, TP=2 and PP=2 on
a random-weight model of the default model's size whose heads divide by 2 (8 heads of 72, see
executor_overhead.py), all three up at once, sampled in the same interleaved rounds (the order
rotating per round); reported: tokens/s medians and the per-round ratios PP=2/TP=2, TP=2/TP=1,
PP=2/TP=1 (median, with their range).

Per cell: tokens/s of the generation, and the worker's idle gap between the end of one step
(its sampling) and the start of the next step's execute_model, measured inside the worker
(`Worker.get_idle_gaps`; the median over the steps of the generation). Reported: the medians over
rounds, the async/sync tokens/s ratio as the median of per-round ratios, and how much of the
synchronous idle gap async removes (1 - async gap / sync gap, median of per-round values).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from _rounds import Rounds, rotated, spread
from executor_overhead import build_tp2_model

from shardserve import LLM, SamplingParams

PROMPT = "Write a long story about a lighthouse keeper and the sea."

BACKENDS = {"uni": {"distributed_executor_backend": "uni"},
            "mp": {"distributed_executor_backend": "mp"}}  # fmt: skip


def build_engines(dtype: str) -> dict[tuple[str, bool], LLM]:
    engines = {}
    for name, options in BACKENDS.items():
        for async_on in (False, True):
            engines[(name, async_on)] = LLM(
                dtype=dtype,
                max_model_len=1024,
                kv_cache_memory_bytes=256 * 2**20,
                max_num_seqs=64,
                async_scheduling=async_on,
                **options,
            )
    return engines


def run_cell(llm: LLM, batch: int, tokens: int) -> tuple[float, float]:
    """(tokens/s, median idle gap in seconds) of one generation."""
    prompts = [f"{PROMPT} ({i})" for i in range(batch)]
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    llm.collective_rpc("get_idle_gaps")  # reset
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    gaps = llm.collective_rpc("get_idle_gaps")[0]
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    return n / elapsed, statistics.median(gaps) if gaps else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--verbose", action="store_true", help="print every cell as it runs")
    parser.add_argument("--parallel-batch", type=int, default=64)
    parser.add_argument("--no-async-table", action="store_true")
    parser.add_argument("--no-parallel-table", action="store_true")
    args = parser.parse_args()
    if not args.no_async_table:
        async_table(args)
    if not args.no_parallel_table:
        parallel_table(args)


PARALLEL = {"TP=1": dict(tensor_parallel_size=1), "TP=2": dict(tensor_parallel_size=2),
            "PP=2": dict(pipeline_parallel_size=2)}  # fmt: skip


def parallel_table(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="shardserve-bench-") as tmp:
        model = str(build_tp2_model(Path(tmp) / "tp2"))
        engines = {
            name: LLM(model, dtype=args.dtype, max_model_len=1024, max_num_seqs=128,
                      kv_cache_memory_bytes=256 * 2**20, distributed_executor_backend="mp",
                      **options)  # fmt: skip
            for name, options in PARALLEL.items()
        }
        try:
            for llm in engines.values():
                run_cell(llm, args.parallel_batch, 8)
            rounds = Rounds()
            for r in range(args.rounds):
                for name in rotated(list(engines), r):
                    tok_s, _ = run_cell(engines[name], args.parallel_batch, args.tokens)
                    rounds.add(name, tok_s)
                    if args.verbose:
                        print(f"  {name} {tok_s:8.1f} tok/s", flush=True)
                print(f"parallel round {r + 1}/{args.rounds} done", flush=True)
        finally:
            for llm in engines.values():
                llm.shutdown()
    print(f"\n8-head random model of the default model's size, mp, dtype={args.dtype}, batch "
          f"{args.parallel_batch}, {args.tokens} new tokens, {args.rounds} interleaved rounds")
    for name in PARALLEL:
        print(f"{name:5} {rounds.median(name):8.1f} tok/s")
    for num, den in (("PP=2", "TP=2"), ("TP=2", "TP=1"), ("PP=2", "TP=1")):
        print(f"{num}/{den}: {rounds.ratio(num, den):.2f}x "
              f"(per-round {spread(rounds.ratios(num, den))})")


def async_table(args: argparse.Namespace) -> None:
    batches = [int(b) for b in args.batches.split(",")]
    engines = build_engines(args.dtype)
    try:
        for llm in engines.values():  # the same warm-up for every engine
            run_cell(llm, max(batches), 8)
        samples: dict[tuple[str, bool, int], list[tuple[float, float]]] = {}
        for r in range(args.rounds):
            for batch in batches:
                for (name, async_on), llm in engines.items():
                    cell = run_cell(llm, batch, args.tokens)
                    samples.setdefault((name, async_on, batch), []).append(cell)
                    if args.verbose:
                        print(f"  {name:4} async={async_on!s:5} batch={batch:3} "
                              f"{cell[0]:8.1f} tok/s  gap {cell[1] * 1e6:7.0f} us", flush=True)
            print(f"round {r + 1}/{args.rounds} done", flush=True)
        report(samples, batches, args)
    finally:
        for llm in engines.values():
            llm.shutdown()


def report(samples: dict, batches: list[int], args: argparse.Namespace) -> None:
    print(f"\ndefault model, dtype={args.dtype}, {args.tokens} new tokens per request, "
          f"{args.rounds} interleaved rounds (medians)")  # fmt: skip
    header = (f"{'backend':8} {'batch':>5} {'sync tok/s':>11} {'async tok/s':>12} {'ratio':>7} "
              f"{'sync gap us':>12} {'async gap us':>13} {'gap cut':>8}")  # fmt: skip
    print(header)
    for batch in batches:
        for name in BACKENDS:
            sync, asyn = samples[(name, False, batch)], samples[(name, True, batch)]
            ratios = [a[0] / s[0] for s, a in zip(sync, asyn, strict=True)]
            cuts = [1 - a[1] / s[1] for s, a in zip(sync, asyn, strict=True)]
            print(
                f"{name:8} {batch:>5} {statistics.median(s[0] for s in sync):>11.1f} "
                f"{statistics.median(a[0] for a in asyn):>12.1f} "
                f"{statistics.median(ratios):>6.2f}x "
                f"{statistics.median(s[1] for s in sync) * 1e6:>12.0f} "
                f"{statistics.median(a[1] for a in asyn) * 1e6:>13.0f} "
                f"{statistics.median(cuts) * 100:>7.0f}%"
            )


if __name__ == "__main__":
    main()
