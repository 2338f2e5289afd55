"""shardserve's side of bench/cpu_vs_llamacpp.py's real-size table, one fresh process per side
and round (so its resident memory is its own and sides never share RAM):

    python bench/_shardserve_side.py '{"model": ..., "options": {...}, "threads": 2, ...}'

Prints one JSON line: rss_mb (VmRSS of this process and its children right after LLM(...)
returned), peak_mb (their VmHWM at the end, after every measurement), load_s (LLM(...)
construction), pp (prompt tok/s of one pp-token prompt, after a warm-up prompt of that length as
llama-bench runs one), tg (batch-1 tok/s from a one-token prompt) and decode {B: tok/s}. The
environment (SHARDSERVE_ISA, SHARDSERVE_NUM_THREADS, SHARDSERVE_QUANT_DENSE_BATCHES) is set by
the parent.

How decode at batch B is timed, to match llama-batched-bench's S_TG (B x ntg / T_TG, where T_TG
covers ntg decode steps of B tokens after a prefill of B x npp): B distinct prompts of npp random
token ids, max_tokens = ntg + 1, greedy, ignore_eos, prefix caching off and
max_num_batched_tokens >= B x npp so every prompt is prefilled in one step and every request's
first token comes from that step; the window runs from that first token to the last request's
last token (RequestOutput.metrics), covering exactly ntg decode steps: tok/s = B x ntg / window.
Unlike llama-batched-bench (logits only, random next tokens) this includes sampling and the
engine's scheduling, i.e. what a user of LLM.generate gets.
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np
import psutil

from shardserve import LLM, SamplingParams
from shardserve.config.model import resolve_dtype
from shardserve.model.gguf_loader import gguf_arch


def tree_mb(field: str) -> float:
    """/proc/PID/status `field` (VmRSS now, VmHWM peak) summed over this process and its
    children (an engine may run workers of its own), in MiB."""
    me = psutil.Process()
    total = 0
    for p in [me, *me.children(recursive=True)]:
        try:
            with open(f"/proc/{p.pid}/status") as f:
                total += next(int(line.split()[1]) for line in f if line.startswith(field + ":"))
        except (OSError, StopIteration):
            pass
    return total / 1024


def kv_bytes(model: str, dtype: str, tokens: int) -> int:
    arch = gguf_arch(model)
    per_token = 2 * arch.num_layers * arch.num_kv_heads * arch.head_dim
    return per_token * tokens * resolve_dtype(dtype, "cpu").itemsize


def kv_dtype(options: dict) -> str:
    """The cache's dtype under a side's options (kv_cache_dtype, else the model's)."""
    kv = options.get("kv_cache_dtype", "auto")
    return options.get("dtype", "auto") if kv == "auto" else kv


def window_rate(outs: list, steps: int) -> tuple[float, float]:
    """(B x steps / decode window, spread of the first tokens as a share of the window)."""
    firsts = [o.metrics.first_token_time for o in outs]
    last = max(o.metrics.last_token_time for o in outs)
    for o in outs:
        got = len(o.outputs[0].token_ids)
        assert got == steps + 1, f"a request stopped after {got} tokens, not {steps + 1}"
    window = last - max(firsts)
    return len(outs) * steps / window, (max(firsts) - min(firsts)) / window


def main() -> None:
    cfg = json.loads(sys.argv[1])
    model, options = cfg["model"], cfg["options"]
    batches, npp, ntg, pp, tg = cfg["batches"], cfg["npp"], cfg["ntg"], cfg["pp"], cfg["tg"]
    most = max(batches)
    block = 16
    tokens = max(most * (npp + ntg + 2 * block), pp + tg + 2 * block)
    t0 = time.perf_counter()
    llm = LLM(model, max_model_len=max(pp, npp + ntg, tg) + 2 * block, max_num_seqs=most,
              max_num_batched_tokens=max(pp, most * npp), enable_prefix_caching=False,
              kv_cache_memory_bytes=kv_bytes(model, kv_dtype(options), tokens),
              **options)
    load_s = time.perf_counter() - t0
    rss = tree_mb("VmRSS")
    vocab = gguf_arch(model).vocab_size
    rng = np.random.default_rng(0)

    def prompts(n: int, length: int) -> list[dict]:
        ids = rng.integers(100, vocab - 100, size=(n, length))
        return [{"prompt_token_ids": row.tolist()} for row in ids]

    def run(p: list[dict], max_tokens: int) -> list:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        return llm.generate(p, params, use_tqdm=False)

    run(prompts(2, 16), 4)  # warm-up: the kernels' first calls
    run(prompts(most, 8), 2)
    result: dict = {"rss_mb": rss, "load_s": load_s, "decode": {}, "first_spread": {}}
    run(prompts(1, pp), 1)  # a warm-up prefill of pp tokens, as llama-bench's own warm-up run
    t0 = time.perf_counter()
    run(prompts(1, pp), 1)
    result["pp"] = pp / (time.perf_counter() - t0)
    result["tg"], _ = window_rate(run(prompts(1, 1), tg + 1), tg)
    for b in batches:
        rate, spread = window_rate(run(prompts(b, npp), ntg + 1), ntg)
        result["decode"][str(b)] = rate
        result["first_spread"][str(b)] = spread
    result["peak_mb"] = tree_mb("VmHWM")
    llm.shutdown()
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
