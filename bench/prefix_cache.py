"""Prefix caching: requests that share a long system prompt, with the cache on and off, in one
run (two engines kept up; the sides take turns within each round, the first rotating).

    python bench/prefix_cache.py [--rounds 5] [--requests 32] [--prefix-words 1400]
                                 [--max-tokens 16] [--dtype auto]

Two measures per side and round, on --requests prompts that share one system prompt of about
--prefix-words words (~1,500 tokens by default) and differ in their last line (greedy,
ignore_eos):
  * time to first token: the requests arrive one after another (each a generate of 1 token,
    the next sent when the previous returned); the system prompt is new each round (its first
    line names the round), so request 1 finds nothing cached and requests 2..N can find it.
    Reported: the median TTFT of requests 2..N. Issue 14's target: >= 5x lower with caching.
  * throughput: all N in one generate of --max-tokens each (the cached side's cache holds
    this round's system prompt by then, as a server's would).
Reported: both, the cache's hit rate (prompt tokens), and cached / uncached ratios (median of
per-round ratios).
"""

from __future__ import annotations

import argparse
import statistics
import time

from _rounds import Rounds, median_or_nan, rotated, spread

from shardserve import LLM, SamplingParams

SIDES = ["prefix cache on", "prefix cache off"]
WORDS = ("the engine schedules requests in batches and keeps their keys and values in blocks "
         "of a paged cache so that memory is shared and nothing is copied ").split()


def prompts(n: int, prefix_words: int, round_index: int = 0) -> list[str]:
    system = " ".join(WORDS[i % len(WORDS)] for i in range(prefix_words))
    return [f"Session {round_index}.\n{system}\nQuestion {i}: what does step {i} do?\nAnswer:"
            for i in range(n)]


def ttft_later_requests(llm: LLM, batch: list[str]) -> float:
    """Median seconds to the first token of requests 2..N sent one after another."""
    first = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    times = []
    for prompt in batch:
        t0 = time.perf_counter()
        llm.generate([prompt], first, use_tqdm=False)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prefix-words", type=int, default=1400)
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()
    batch = prompts(args.requests, args.prefix_words)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    engines = {side: LLM(args.model, dtype=args.dtype, max_model_len=2048,
                         max_num_seqs=args.requests,
                         enable_prefix_caching=side == SIDES[0]) for side in SIDES}
    samples = Rounds()
    try:
        for llm in engines.values():  # warm-up (fills the cached side's cache, as a server's)
            llm.generate(batch[:2], params, use_tqdm=False)
        for r in range(args.rounds):
            fresh = prompts(args.requests, args.prefix_words, r + 1)
            for side in rotated(SIDES, r):
                samples.add((side, "ttft"), ttft_later_requests(engines[side], fresh))
                t0 = time.perf_counter()
                outs = engines[side].generate(fresh, params, use_tqdm=False)
                elapsed = time.perf_counter() - t0
                samples.add((side, "req/s"), len(outs) / elapsed)
                samples.add((side, "tok/s"), sum(len(o.outputs[0].token_ids) for o in outs)
                            / elapsed)
            print(f"round {r + 1}/{args.rounds} done", flush=True)
        metrics = engines[SIDES[0]].get_metrics()
        prompt_len = len(engines[SIDES[0]].get_tokenizer().encode(batch[0]))
    finally:
        for llm in engines.values():
            llm.shutdown()
    ratios = samples.ratios((SIDES[0], "req/s"), (SIDES[1], "req/s"))
    ttft = samples.ratios((SIDES[1], "ttft"), (SIDES[0], "ttft"))
    print(f"\nmodel={args.model or 'default'} dtype={args.dtype} requests={args.requests} "
          f"prompt ~{prompt_len} tokens, max_tokens={args.max_tokens}, {args.rounds} rounds")
    print("| side | median TTFT, requests 2..N (ms) | requests/s | output tokens/s |\n"
          "|---|---|---|---|")
    for side in SIDES:
        print(f"| {side} | {samples.median((side, 'ttft')) * 1e3:.1f} | "
              f"{samples.median((side, 'req/s')):.2f} | {samples.median((side, 'tok/s')):.1f} |")
    print(f"\nuncached / cached TTFT of requests 2..N: {median_or_nan(ttft):.2f}x "
          f"({spread(ttft)}); target >= 5x")
    print(f"\ncached / uncached requests/s: {median_or_nan(ratios):.2f} ({spread(ratios)}); "
          f"hit rate on the cached side: {metrics['prefix_cache_hit_rate']:.2f} "
          f"({metrics['prefix_cache_hits']} of {metrics['prefix_cache_queries']} prompt tokens)")


if __name__ == "__main__":
    main()
