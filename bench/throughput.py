"""Offline throughput: shardserve vs HF transformers on the default model, in one run.

    python bench/throughput.py [--num-prompts 64] [--max-tokens 128] [--dtypes float32,bfloat16]
                               [--rounds 2]

Prints, per dtype, output tokens/s of shardserve (all prompts at once, continuous batching) and of
HF transformers' batched `generate` (batch 32, left padding), with the ratio; then batch-1 decode
tokens/s beside the memory-bandwidth bound (weight bytes / measured copy bandwidth). The two
engines are measured in turn, --rounds times (default 2), and each keeps its best round.
"""

from __future__ import annotations

import argparse
import gc
import time

import torch

from shardserve import LLM, SamplingParams
from shardserve.model.loader import default_model_path

TOPICS = [
    "the ocean",
    "a city at night",
    "machine learning",
    "an old library",
    "mountains",
    "a chess game",
    "the history of bread",
    "volcanoes",
]
STYLES = ["Write a story about", "Explain to a child", "List facts about", "Describe"]


def make_prompts(n: int) -> list[str]:
    return [f"{STYLES[i % len(STYLES)]} {TOPICS[(i // 4) % len(TOPICS)]} (#{i}):" for i in range(n)]


def copy_bandwidth() -> float:
    """Bytes copied per second by a large tensor copy (best of 5)."""
    src = torch.ones(64 * 2**20, dtype=torch.float32)  # 256 MiB
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return src.numel() * src.element_size() / best


def shardserve_round(llm: LLM, prompts: list[str], max_tokens: int) -> dict[str, float]:
    """One timed 64 x 128 generate and one batch-1 decode measurement on a warm engine."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    # Batch-1 decode: the difference between a long and a 1-token generation isolates decode.
    one = [prompts[0]]
    t1 = _timed(lambda: llm.generate(one, SamplingParams(max_tokens=1), use_tqdm=False))
    tn = _timed(
        lambda: llm.generate(
            one, SamplingParams(max_tokens=65, ignore_eos=True, temperature=0), use_tqdm=False
        )
    )
    return {"tok_s": tokens / elapsed, "decode1": 64 / (tn - t1)}


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def bench_hf(model, tokenizer, prompts: list[str], max_tokens: int, batch: int = 32) -> float:
    tokens = 0
    t0 = time.perf_counter()
    for i in range(0, len(prompts), batch):
        enc = tokenizer(prompts[i : i + batch], return_tensors="pt", padding=True)
        with torch.inference_mode():
            out = model.generate(
                **enc,
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
            )
        tokens += (out.shape[1] - enc["input_ids"].shape[1]) * out.shape[0]
    return tokens / (time.perf_counter() - t0)


def load_hf():
    import transformers

    path = default_model_path()
    tok = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()
    return model, tok


def bench_dtype(dtype: str, hf_model, hf_tok, prompts: list[str], args) -> tuple[dict, float]:
    """Both engines in turn, --rounds times, best of each: this VM's speed drifts by +-10% over
    minutes, and one engine measured after the other would compare the drift, not the engines."""
    llm = LLM(dtype=dtype, max_model_len=1024, max_num_seqs=128)
    llm.generate(prompts[:2], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    weight_bytes = sum(
        p.numel() * p.element_size()
        for p in llm.engine.core.executor.worker.model_runner.model.parameters()
    )
    model = hf_model.to(getattr(torch, dtype))
    ours = {"tok_s": 0.0, "decode1": 0.0}
    theirs = 0.0
    for _ in range(args.rounds):
        r = shardserve_round(llm, prompts, args.max_tokens)
        ours = {k: max(ours[k], r[k]) for k in ours}
        theirs = max(theirs, bench_hf(model, hf_tok, prompts, args.max_tokens))
    llm.shutdown()
    return {**ours, "weight_bytes": weight_bytes}, theirs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds; best of each")
    args = ap.parse_args()
    prompts = make_prompts(args.num_prompts)
    torch.set_num_threads(torch.get_num_threads())
    bw = copy_bandwidth()
    hf_model, hf_tok = load_hf()
    rows = []
    for dtype in args.dtypes.split(","):
        rows.append((dtype, *bench_dtype(dtype, hf_model, hf_tok, prompts, args)))
        gc.collect()
    print(
        f"\n{args.num_prompts} prompts x {args.max_tokens} new tokens, default model, "
        f"{torch.get_num_threads()} threads; copy bandwidth {bw / 1e9:.1f} GB/s"
    )
    print(
        f"{'dtype':<10}{'shardserve tok/s':>18}{'HF tok/s (b=32)':>18}{'ratio':>8}"
        f"{'b=1 decode tok/s':>18}{'bound tok/s':>13}{'of bound':>10}"
    )
    for dtype, ours, theirs in rows:
        bound = bw / ours["weight_bytes"]
        print(
            f"{dtype:<10}{ours['tok_s']:>18.1f}{theirs:>18.1f}{ours['tok_s'] / theirs:>7.2f}x"
            f"{ours['decode1']:>18.1f}{bound:>13.1f}{ours['decode1'] / bound:>9.0%}"
        )


if __name__ == "__main__":
    main()
