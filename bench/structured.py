"""Structured-output overhead: output tokens/s with and without a JSON schema, at batch 1 and
batch 32, in one run (one engine; the sides take turns within each round, the first rotating).

    python bench/structured.py [--rounds 5] [--tokens 64] [--batches 1,32] [--dtype auto]
                               [--no-async-scheduling]

Both sides produce exactly --tokens tokens a request: the unconstrained side ignores EOS, and the
schema (an object holding a list of at least 40 short strings) cannot be complete before that,
so the constrained side is cut by max_tokens too. Greedy. The ratio is constrained / free within
each round; the table shows the median of the per-round ratios and their range.
"""

from __future__ import annotations

import argparse
import time

from _rounds import Rounds, make_prompts, median_or_nan, rotated, spread

from shardserve import LLM, SamplingParams
from shardserve.sampling_params import StructuredOutputsParams

SCHEMA = {"type": "object", "required": ["items"], "additionalProperties": False,
          "properties": {"items": {"type": "array", "minItems": 40,
                                   "items": {"type": "string", "maxLength": 8}}}}
SIDES = ["free", "json schema"]


def params(side: str, tokens: int) -> SamplingParams:
    if side == "free":
        return SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    return SamplingParams(temperature=0, max_tokens=tokens,
                          structured_outputs=StructuredOutputsParams(json=SCHEMA))


def run(llm: LLM, side: str, batch: int, tokens: int) -> float:
    """Output tokens/s of one generate of `batch` prompts."""
    t0 = time.perf_counter()
    outs = llm.generate(make_prompts(batch), params(side, tokens), use_tqdm=False)
    elapsed = time.perf_counter() - t0
    produced = [len(o.outputs[0].token_ids) for o in outs]
    if any(n != tokens for n in produced):
        raise RuntimeError(f"{side}: a request stopped early ({produced}); the figures would "
                           f"compare different batch sizes")
    return sum(produced) / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--no-async-scheduling", action="store_true")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    llm = LLM(args.model, dtype=args.dtype, max_model_len=512, max_num_seqs=max(batches),
              async_scheduling=not args.no_async_scheduling)
    samples = Rounds()
    try:
        for batch in batches:  # warm-up: compiles the grammar, touches every code path
            for side in SIDES:
                run(llm, side, batch, 8)
        for r in range(args.rounds):
            for batch in batches:
                for side in rotated(SIDES, r):
                    samples.add((batch, side), run(llm, side, batch, args.tokens))
            print(f"round {r + 1}/{args.rounds} done", flush=True)
    finally:
        llm.shutdown()
    print(f"\nmodel={args.model or 'default'} dtype={args.dtype} tokens={args.tokens} "
          f"async_scheduling={not args.no_async_scheduling}, {args.rounds} rounds; ratio: "
          f"median of per-round ratios")
    print("| batch | free tok/s | json schema tok/s | schema / free | range |")
    print("|---|---|---|---|---|")
    for batch in batches:
        ratios = samples.ratios((batch, "json schema"), (batch, "free"))
        print(f"| {batch} | {samples.median((batch, 'free')):.1f} | "
              f"{samples.median((batch, 'json schema')):.1f} | {median_or_nan(ratios):.2f} | "
              f"{spread(ratios)} |")


if __name__ == "__main__":
    main()
