"""Per-step cost of each executor backend on decode, in one run.

    python bench/executor_overhead.py [--steps 32] [--rounds 5] [--batches 1,32] [--dtype auto]

Rows: uni, mp TP=1 (default model), and mp TP=2 on a random-weight model of the default model's
size whose heads divide by 2 (8 heads of 72 instead of 9 of 64). Decode step latency is isolated
as (time of 1 + N tokens - time of 1 token) / N. Also the bare round trip of collective_rpc (a
no-op method on every rank). With the [ray] extra installed: ray (actor calls), ray (compiled
graph) and ray_v2 rows, each compared with the matching mp row.

How the figures are computed: every engine gets the same warm-up (a 2-step sample at each batch
size) and then all rows are sampled in the same --rounds interleaved rounds: in each round every
engine takes its turn (each batch size, then the rpc round trip), the first engine rotating from
round to round. Every comparison is taken within a round - overhead vs uni (us and %), TP=2 vs
TP=1, ray vs mp - and reported as the median of the per-round values (ranges in the ratio lines).
ms/step, tok/s and rpc us are medians over the rounds.

Every engine stays up for the whole run except `ray TP=1 (graph)`: a compiled graph's readers poll
their channels, so an idle compiled-graph engine keeps most of a core busy (measured here: 0.85 of
this VM's 2 cores, against 0.02-0.03 for idle Ray actors, ray_v2 or mp workers) and would slow
every other row. That engine is started for its turn in each round (its start is not timed; it
gets the same warm-up) and shut down after it; the other rows are sampled with it down.
Ray is started once, before any engine, so its own background cost (~0.04 cores) is the same for
every row; it is given enough logical CPUs for all Ray engines at once (a rank's torch threads
still follow its ray_cpus_per_worker: all cores at TP=1, half each at TP=2, as mp does).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from _rounds import Rounds, median_or_nan, rotated, spread

from shardserve import LLM, SamplingParams

PROMPT = "Write a long story about a lighthouse keeper and the sea."
SETTLE_S = 2.0  # after a per-turn engine's shutdown, for its processes to exit


@dataclass
class Spec:
    label: str
    model: str | None
    kwargs: dict = field(default_factory=dict)
    per_turn: bool = False  # started for its turn in each round and shut down after


def build_tp2_model(folder: Path) -> Path:
    """A random-weight Llama with the default model's sizes, 8 heads (divisible by 2)."""
    import torch
    import transformers

    from shardserve.model.loader import default_model_path, load_tokenizer

    config = transformers.LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=8, num_key_value_heads=4, head_dim=72, max_position_embeddings=2048,
        rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True, bos_token_id=1,
        eos_token_id=2, architectures=["LlamaForCausalLM"],
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    load_tokenizer(default_model_path()).save_pretrained(folder)
    return folder


def decode_sample(llm: LLM, batch: int, steps: int) -> float:
    """Seconds per decode step at this batch size, from one (1 + steps) and one 1-token run."""
    prompts = [f"{PROMPT} ({i})" for i in range(batch)]

    def run(n: int) -> float:
        params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
        t0 = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - t0

    return (run(1 + steps) - run(1)) / steps


def rpc_round_trip(llm: LLM, n: int = 300) -> float:
    executor = llm.engine.core.executor
    for _ in range(20):
        executor.collective_rpc("get_rank")
    t0 = time.perf_counter()
    for _ in range(n):
        executor.collective_rpc("get_rank")
    return (time.perf_counter() - t0) / n


def start(spec: Spec, batches: list[int], dtype: str) -> LLM:
    """The engine, warmed up the same way as every other."""
    llm = LLM(spec.model, max_model_len=1024, kv_cache_memory_bytes=256 << 20, dtype=dtype,
              **spec.kwargs)  # fmt: skip
    for b in batches:
        decode_sample(llm, b, 2)
    return llm


def take_turn(llm: LLM, label: str, samples: Rounds, batches: list[int], steps: int) -> None:
    for b in batches:
        samples.add((label, b), decode_sample(llm, b, steps))
    samples.add((label, "rpc"), rpc_round_trip(llm))


def measure_interleaved(specs: list[Spec], batches: list[int], steps: int, rounds: int,
                        dtype: str) -> Rounds:  # fmt: skip
    """Every engine up (but per_turn ones), sampled in turn, round after round."""
    samples = Rounds()
    engines: dict[str, LLM] = {}
    try:
        for spec in specs:
            if not spec.per_turn:
                engines[spec.label] = start(spec, batches, dtype)
        for r in range(rounds):
            t0 = time.perf_counter()
            for spec in rotated(specs, r):
                llm = engines.get(spec.label) or start(spec, batches, dtype)
                try:
                    take_turn(llm, spec.label, samples, batches, steps)
                finally:
                    if spec.per_turn:
                        llm.shutdown()
                        time.sleep(SETTLE_S)
            print(f"round {r + 1}/{rounds} done in {time.perf_counter() - t0:.0f} s", flush=True)
    finally:
        for llm in engines.values():
            llm.shutdown()
    return samples


def mp_specs(tp2_model: str) -> list[Spec]:
    return [
        Spec("uni", None, dict(distributed_executor_backend="uni")),
        Spec("mp TP=1", None, dict(distributed_executor_backend="mp")),
        Spec("uni (8-head model)", tp2_model, dict(distributed_executor_backend="uni")),
        Spec("mp TP=1 (8-head)", tp2_model, dict(distributed_executor_backend="mp")),
        Spec("mp TP=2 (8-head)", tp2_model,
             dict(distributed_executor_backend="mp", tensor_parallel_size=2)),
    ]  # fmt: skip


def ray_specs(tp2_model: str, cores: int) -> list[Spec]:
    """TP=1 on the default model (against `mp TP=1`), ray_v2 TP=2 (against `mp TP=2 (8-head)`).
    A Ray rank runs as many torch threads as its bundle has CPUs; reserve what an mp worker
    would use (all cores at TP=1, half each at TP=2) so the rows compare the executors."""
    tp1 = dict(ray_cpus_per_worker=cores)
    return [
        Spec("ray TP=1 (actors)", None,
             dict(distributed_executor_backend="ray", ray_use_compiled_graph=False, **tp1)),
        Spec("ray TP=1 (graph)", None,
             dict(distributed_executor_backend="ray", ray_use_compiled_graph=True, **tp1),
             per_turn=True),
        Spec("ray_v2 TP=1", None, dict(distributed_executor_backend="ray_v2", **tp1)),
        Spec("ray_v2 TP=2 (8-head)", tp2_model,
             dict(distributed_executor_backend="ray_v2", tensor_parallel_size=2,
                  ray_cpus_per_worker=max(1, cores // 2))),
    ]  # fmt: skip


def run_all(args: argparse.Namespace, batches: list[int], tp2_model: str) -> tuple[Rounds, list]:
    specs = mp_specs(tp2_model)
    if importlib.util.find_spec("ray") is None:
        print("ray is not installed (pip install -e '.[ray]'): no ray rows")
        return measure_interleaved(specs, batches, args.steps, args.rounds, args.dtype), specs
    import ray

    cores = len(os.sched_getaffinity(0))
    specs += ray_specs(tp2_model, cores)
    # Logical CPUs for every Ray engine at once (4 engines of `cores` CPUs each).
    ray.init(num_cpus=4 * cores, include_dashboard=False)
    try:
        return measure_interleaved(specs, batches, args.steps, args.rounds, args.dtype), specs
    finally:
        ray.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds; medians")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    with tempfile.TemporaryDirectory(prefix="shardserve-bench-") as tmp:
        samples, specs = run_all(args, batches, str(build_tp2_model(Path(tmp))))
    report(samples, [s.label for s in specs], batches, args.rounds)


def uni_of(label: str) -> str:
    return "uni (8-head model)" if "8-head" in label else "uni"


def row_line(s: Rounds, label: str, batches: list[int]) -> str:
    line = f"{label:<22}{s.median((label, 'rpc')) * 1e6:>9.0f}"
    ref = uni_of(label)
    for b in batches:
        over_us = median_or_nan(s.per_round(lambda x, y: (x - y) * 1e6, (label, b), (ref, b)))
        over_pct = median_or_nan([x - 1 for x in s.ratios((label, b), (ref, b))])
        step = s.median((label, b))
        line += f"{step * 1e3:>15.2f}{b / step:>9.1f}{over_us:>+10.0f}us{over_pct:>+8.1%}"
    return line


def report(s: Rounds, labels: list[str], batches: list[int], rounds: int) -> None:
    print(f"\ndecode step latency, dtype per --dtype, {rounds} interleaved rounds; 'vs uni': "
          "median of per-round differences with the uni row of the same model")  # fmt: skip
    head = f"{'backend':<22}{'rpc us':>9}"
    for b in batches:
        head += f"{f'b={b} ms/step':>15}{'tok/s':>9}{'vs uni':>20}"
    print(head)
    for label in labels:
        print(row_line(s, label, batches))
    print("\nmedian of per-round ratios (range over rounds)")
    tp1, tp2 = "mp TP=1 (8-head)", "mp TP=2 (8-head)"
    for b in batches:
        ratios = s.ratios((tp1, b), (tp2, b))  # step time TP=1 / TP=2 = tokens/s TP=2 / TP=1
        print(f"TP=2 / TP=1 tokens/s at b={b}: {median_or_nan(ratios):.2f}x ({spread(ratios)})")
    for label, mp_label in (
        ("ray TP=1 (actors)", "mp TP=1"),
        ("ray TP=1 (graph)", "mp TP=1"),
        ("ray_v2 TP=1", "mp TP=1"),
        ("ray_v2 TP=2 (8-head)", "mp TP=2 (8-head)"),
    ):
        if label in labels:
            parts = []
            for b in batches:
                deltas = [x - 1 for x in s.ratios((label, b), (mp_label, b))]
                parts.append(f"b={b} {median_or_nan(deltas):+.1%} ({spread(deltas, '+.1%')})")
            print(f"{label} step time vs {mp_label}: {', '.join(parts)}")


if __name__ == "__main__":
    main()
