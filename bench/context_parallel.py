"""Context parallelism: time to first token of a long prompt with PCP=2 against TP=2 and one
rank, and decode tokens/s with DCP=2 against TP=2 alone on a 1-KV-head model.

    python bench/context_parallel.py [--rounds 3] [--prompt-lens 4096,8192] [--dtype auto]
                                     [--decode-context 2048] [--batch 8] [--parts ttft,decode]

Both parts run a random-weight model of the default model's depth and about its width that TP=2
can shard (the default model's 9 heads cannot): 30 layers, hidden 512, 8 query heads of 64 and 1
KV head (replicated at TP=2), FFN 1536, the default model's tokenizer and vocabulary, bfloat16.

TTFT: four engines stay up, each on the mp backend so that each rank is a process with its own
thread count (SHARDSERVE_NUM_THREADS at its start):
  1 rank x 1 thread, 1 rank x 2 threads, TP=2 (1 thread a rank), PCP=2 (1 thread a rank).
Per round and prompt length, each engine prefills a fresh prompt (prefix caching off) and
samples one token; the first side rotates from round to round. Reported: median seconds, and
PCP=2 / each other side as medians of per-round ratios. The issue's targets at 8,192 tokens:
PCP=2 <= 0.6 x one single-thread rank, <= 1.0 x TP=2, <= 1.1 x one rank with two threads.

Decode: TP=2 and TP=2 x DCP=2, `--batch` requests of
`--decode-context` prompt tokens each, prefilled in one step, then generating 64 tokens
together; decode tokens/s = the 63 x batch tokens after the first over the time from the first
token to the last, per round. Target: DCP >= 0.7 x TP-only.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

from _rounds import Rounds, rotated, spread, timed

from shardserve import LLM, SamplingParams

_TTFT_SIDES = {  # name -> (threads a rank, engine options)
    "1 rank x 1 thread": (1, {}),
    "1 rank x 2 threads": (2, {}),
    "TP=2": (1, {"tensor_parallel_size": 2}),
    "PCP=2": (1, {"prefill_context_parallel_size": 2}),
}


def _engine(threads: int, **options) -> LLM:
    os.environ["SHARDSERVE_NUM_THREADS"] = str(threads)  # read by each worker as it starts
    try:
        return LLM(distributed_executor_backend="mp", enable_prefix_caching=False, **options)
    finally:
        os.environ.pop("SHARDSERVE_NUM_THREADS", None)


def _prompt(llm: LLM, n: int, salt: int) -> dict:
    """n token ids of plain text, different for every salt (nothing cached between runs)."""
    tok = llm.get_tokenizer()
    text = " ".join(f"note {salt}-{i}: the value {i * 31 % 97} follows." for i in range(n // 6))
    ids = tok.encode(text)[:n]
    assert len(ids) == n, (len(ids), n)
    return {"prompt_token_ids": ids}


def bench_ttft(args: argparse.Namespace, model: str) -> None:
    lens = [int(x) for x in args.prompt_lens.split(",")]
    max_len = min(max(lens) + 8, 8192)  # the default model's positions: a prompt of 8,192
    # tokens leaves no room for the one it samples, so that row's prompt is 8,191 (+ 1)
    engines = {name: _engine(threads, model=model, dtype=args.dtype, max_model_len=max_len,
                             **opts)
               for name, (threads, opts) in _TTFT_SIDES.items()}
    one = SamplingParams(max_tokens=1, temperature=0)
    rounds = Rounds()
    try:
        for r in range(args.rounds):
            for n in lens:
                for name in rotated(list(engines), r):
                    llm = engines[name]
                    prompt = _prompt(llm, min(n, max_len - 1), salt=r * 1000 + n)
                    rounds.add((n, name), timed(
                        lambda llm=llm, prompt=prompt: llm.generate([prompt], one,
                                                                    use_tqdm=False)))
            print(f"round {r + 1}/{args.rounds} done", flush=True)
    finally:
        for llm in engines.values():
            llm.shutdown()
    print(f"\nTTFT (s), 1-KV-head model, dtype {args.dtype}, {args.rounds} rounds: median "
          f"(range); PCP=2 / side = median of per-round ratios (range)")
    print("| prompt | " + " | ".join(engines) + " | " +
          " | ".join(f"PCP=2 / {s}" for s in engines if s != "PCP=2") + " |")
    print("|---" * (2 * len(engines)) + "|")
    for n in lens:
        cells = [f"{rounds.median((n, s)):.2f}" for s in engines]
        ratios = [f"{rounds.ratio((n, 'PCP=2'), (n, s)):.2f} "
                  f"({spread(rounds.ratios((n, 'PCP=2'), (n, s)))})"
                  for s in engines if s != "PCP=2"]
        print(f"| {n} | " + " | ".join(cells + ratios) + " |")


def one_kv_head_model(folder: Path) -> Path:
    """Random weights at the default model's width with one KV head, the default tokenizer."""
    import torch
    import transformers

    from shardserve.model.loader import default_model_path

    gguf = default_model_path()
    tok = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config = transformers.LlamaConfig(
        vocab_size=len(tok), hidden_size=512, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=8, num_key_value_heads=1, max_position_embeddings=8192,
        rope_theta=100000.0, tie_word_embeddings=True, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id, architectures=["LlamaForCausalLM"])
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def bench_decode(args: argparse.Namespace, model: str) -> None:
    max_len = args.decode_context + 72
    engines = {f"TP=2{extra}": _engine(1, model=model, dtype=args.dtype,
                                        max_model_len=max_len, tensor_parallel_size=2,
                                        decode_context_parallel_size=dcp,
                                        max_num_batched_tokens=max_len * args.batch)
               for extra, dcp in (("", 1), (" x DCP=2", 2))}
    rounds = Rounds()
    try:
        for r in range(args.rounds):
            for name in rotated(list(engines), r):
                rounds.add(name, _decode_rate(engines[name], args, salt=r))
            print(f"round {r + 1}/{args.rounds} done", flush=True)
    finally:
        for llm in engines.values():
            llm.shutdown()
    names = list(engines)
    print(f"\ndecode tok/s, 1-KV-head model, batch {args.batch} x {args.decode_context} "
          f"context, {args.rounds} rounds")
    print("| side | tok/s (median) | range |\n|---|---|---|")
    for name in names:
        print(f"| {name} | {rounds.median(name):.1f} | {spread(rounds.values(name), '.1f')} |")
    print(f"DCP / TP-only: {rounds.ratio(names[1], names[0]):.2f} "
          f"({spread(rounds.ratios(names[1], names[0]))})  target >= 0.7")


def _decode_rate(llm: LLM, args: argparse.Namespace, salt: int) -> float:
    """Decode tokens/s of `--batch` requests that prefill in one step (the budget holds them
    all) and then decode together: 63 tokens each after the first, over the time from the
    first token to the last (the slowest request's; they run in the same steps)."""
    prompts = [_prompt(llm, args.decode_context, salt * 100 + i) for i in range(args.batch)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=64, ignore_eos=True, temperature=0),
                        use_tqdm=False)
    spans = [o.metrics.last_token_time - o.metrics.first_token_time for o in outs]
    return 63 * args.batch / max(spans)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompt-lens", default="4096,8192")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--decode-context", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--parts", default="ttft,decode")
    args = parser.parse_args()
    parts = args.parts.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        model = str(one_kv_head_model(Path(tmp)))
        if "ttft" in parts:
            bench_ttft(args, model)
        if "decode" in parts:
            bench_decode(args, model)


if __name__ == "__main__":
    main()
