"""Per-step cost of each executor backend on decode, in one run.

    python bench/executor_overhead.py [--steps 32] [--rounds 5] [--batches 1,32] [--dtype auto]

Rows: uni, mp TP=1 (default model), and mp TP=2 on a random-weight model of the default model's
size whose heads divide by 2 (8 heads of 72 instead of 9 of 64). Decode step latency is isolated
as (time of 1 + N tokens - time of 1 token) / N; the mp overhead is reported against uni in
microseconds and percent, and TP=2 as a ratio of TP=1 tokens/s. Also the bare round trip of
collective_rpc (a no-op method on every rank). With the [ray] extra installed: ray (actor
calls), ray (compiled graph) and ray_v2 rows, each compared with the matching mp row.
Each figure is the median of --rounds samples; the uni and mp engines stay up together and are
sampled in turn, so the machine's drift hits every row alike.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import tempfile
import time
from pathlib import Path

from shardserve import LLM, SamplingParams

PROMPT = "Write a long story about a lighthouse keeper and the sea."


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


def measure_interleaved(
    specs: list[tuple[str, str | None, dict]],
    batches: list[int],
    steps: int,
    rounds: int,
    **common,
) -> list[dict]:
    """All engines stay up and are sampled in turn, round after round; each row is the median.

    On a shared 2-core VM the speed drifts by 10% over minutes, so measuring engines one after
    another compared drift, not backends; interleaving puts every engine under the same drift.
    """
    engines = []
    try:
        for label, model, kwargs in specs:
            llm = LLM(model, max_model_len=1024, kv_cache_memory_bytes=256 << 20, **common,
                      **kwargs)  # fmt: skip
            engines.append((label, llm))
            for b in batches:
                decode_sample(llm, b, 2)  # warm-up
        samples = {(label, b): [] for label, _ in engines for b in batches}
        for _ in range(rounds):
            for label, llm in engines:
                for b in batches:
                    samples[label, b].append(decode_sample(llm, b, steps))
        rows = []
        for label, llm in engines:
            row = {"label": label, "rpc": rpc_round_trip(llm)}
            row.update({b: statistics.median(samples[label, b]) for b in batches})
            rows.append(row)
        return rows
    finally:
        for _, llm in engines:
            llm.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    run = dict(batches=batches, steps=args.steps, rounds=args.rounds, dtype=args.dtype)
    with tempfile.TemporaryDirectory(prefix="shardserve-bench-") as tmp:
        tp2_model = str(build_tp2_model(Path(tmp)))
        rows = measure_interleaved(
            [
                ("uni", None, dict(distributed_executor_backend="uni")),
                ("mp TP=1", None, dict(distributed_executor_backend="mp")),
                ("uni (8-head model)", tp2_model, dict(distributed_executor_backend="uni")),
                ("mp TP=1 (8-head)", tp2_model, dict(distributed_executor_backend="mp")),
                ("mp TP=2 (8-head)", tp2_model,
                 dict(distributed_executor_backend="mp", tensor_parallel_size=2)),
            ],
            **run,
        )  # fmt: skip
        rows += ray_rows(tp2_model, run)
    report(rows, batches)


def ray_rows(tp2_model: str, run: dict) -> list[dict]:
    """The Ray backends beside mp (skipped without the [ray] extra): TP=1 on the default model
    against `mp TP=1`, and ray_v2 TP=2 against `mp TP=2 (8-head)`. One engine at a time: idle
    compiled-graph readers poll and would slow whatever runs beside them."""
    if importlib.util.find_spec("ray") is None:
        print("ray is not installed (pip install -e '.[ray]'): no ray rows")
        return []
    import ray

    # A Ray rank runs as many torch threads as its bundle has CPUs; reserve what an mp worker
    # would use (all cores at TP=1, half each at TP=2) so the rows compare the executors.
    cores = len(os.sched_getaffinity(0))
    tp1 = dict(ray_cpus_per_worker=cores)
    specs = [
        ("ray TP=1 (actors)", None,
         dict(distributed_executor_backend="ray", ray_use_compiled_graph=False, **tp1)),
        ("ray TP=1 (graph)", None,
         dict(distributed_executor_backend="ray", ray_use_compiled_graph=True, **tp1)),
        ("ray_v2 TP=1", None, dict(distributed_executor_backend="ray_v2", **tp1)),
        ("ray_v2 TP=2 (8-head)", tp2_model,
         dict(distributed_executor_backend="ray_v2", tensor_parallel_size=2,
              ray_cpus_per_worker=max(1, cores // 2))),
    ]  # fmt: skip
    ray.init(num_cpus=cores, include_dashboard=False)
    try:
        return [row for spec in specs for row in measure_interleaved([spec], **run)]
    finally:
        ray.shutdown()


def report(rows: list[dict], batches: list[int]) -> None:
    base = {r["label"]: r for r in rows}
    print("\ndecode step latency, dtype per --dtype; overhead vs the uni row of the same model")
    head = f"{'backend':<22}{'rpc us':>9}"
    for b in batches:
        head += f"{f'b={b} ms/step':>15}{'tok/s':>9}{'vs uni':>16}"
    print(head)
    for r in rows:
        ref = base["uni (8-head model)" if "8-head" in r["label"] else "uni"]
        line = f"{r['label']:<22}{r['rpc'] * 1e6:>9.0f}"
        for b in batches:
            over = (r[b] - ref[b]) * 1e6
            line += (
                f"{r[b] * 1e3:>15.2f}{b / r[b]:>9.1f}{over:>+9.0f}us{over / (ref[b] * 1e4):>+6.1f}%"
            )
        print(line)
    tp1, tp2 = base["mp TP=1 (8-head)"], base["mp TP=2 (8-head)"]
    for b in batches:
        print(f"TP=2 / TP=1 tokens/s at b={b}: {tp1[b] / tp2[b]:.2f}x")
    for label, mp_label in (
        ("ray TP=1 (actors)", "mp TP=1"),
        ("ray TP=1 (graph)", "mp TP=1"),
        ("ray_v2 TP=1", "mp TP=1"),
        ("ray_v2 TP=2 (8-head)", "mp TP=2 (8-head)"),
    ):
        if label in base:
            ratios = ", ".join(
                f"b={b} {base[label][b] / base[mp_label][b] - 1:+.1%}" for b in batches
            )
            print(f"{label} step time vs {mp_label}: {ratios}")


if __name__ == "__main__":
    main()
