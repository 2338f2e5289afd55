"""Speculative decoding without a draft model (n-gram and suffix lookup) against none, on
prompts the default model really copies from and on free writing, at batch 1 and batch 32.

    python bench/spec_decode.py [--rounds 3] [--max-tokens 128] [--k 4] [--sets code,...]
                                [--sides none,ngram,suffix,ngram-sync,ngram@8] [--batch 1,32]
                                [--dtype auto]
                                [--llama-server PATH --llama-gguf FILE --llama-args "..."]

Sets (greedy, one engine per side kept up; the sides take turns within each round, the first
rotating; tokens/s over the set's outputs):
  copy     a source file shown twice, then the start of a third copy (raw prompt)
  code     chat: a given function with the function renamed / typos fixed in a paragraph
  quotes   chat: summarize a passage quoting its key sentences
  free     chat: free writing (nothing to copy: the set that must not get slower)
Batch 1 runs the set's prompts one after another; batch 32 runs 32 requests (the set's prompts
repeated) in one generate.

Reported per set and batch: tokens/s of each side, its ratio to `none` (median of per-round
ratios, with their range), the mean acceptance length measured (tokens a verify step emits,
from LLM.get_metrics) and the ideal one: n-gram lookup replayed over the greedy output without
speculation (at each step, how many of the k proposed tokens the output really continues
with, plus one), the most prompt lookup could give on that text.

--llama-server: llama.cpp's server binary (built from the llama-cpp-python sdist's vendored
source) on --llama-gguf (the same GGUF), at the same thread count, driven over HTTP
(/completion, n_predict, temperature 0, one request at a time: batch 1 only). Its n-gram
speculation is enabled with --llama-args (the flags of the vendored version, e.g.
"--spec-type ngram-simple --draft-max 4"); the bench adds -m, -t, --port.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
import urllib.request

from _rounds import Rounds, median_or_nan, rotated, spread

from shardserve import LLM, SamplingParams
from shardserve.worker.spec_decode.ngram import NgramProposer

CODE = '''def moving_average(values, window):
    """The mean of each run of `window` consecutive values."""
    if window <= 0:
        raise ValueError("window must be positive")
    totals = []
    running = 0.0
    for index, value in enumerate(values):
        running += value
        if index >= window:
            running -= values[index - window]
        if index >= window - 1:
            totals.append(running / window)
    return totals
'''
PARAGRAPH = ("The scheduler admits waiting requests in the order they arrived, gives each "
             "running request one token per step, and preempts the most recently admitted "
             "request when the cache runs out of blocks. A preempted reqeust is recomputed "
             "from its prompt and its output so far when blocks are free again.")
PASSAGE = ("Paged attention keeps the keys and values of every request in fixed-size blocks. "
           "A request's block table maps its positions to blocks, so memory is allocated as "
           "the sequence grows and never copied. Blocks whose tokens match an earlier "
           "request's can be shared, which is what prefix caching does. When the pool runs "
           "dry, a request is preempted and its blocks return to the pool.")
SETS = {
    "copy": [("raw", CODE + "\n\n" + CODE + "\n\n" + CODE.split("\n", 1)[0] + "\n")],
    # The default model (135M) copies these nearly verbatim (replayed prompt lookup: ~3.0 and
    # ~4.4 tokens a step); asked to rename a variable it rewrote the function instead (~1.8).
    "code": [("chat", "Here is a Python function:\n\n```python\n" + CODE + "```\n\nRename "
              "the function to `rolling_mean`. Output the full code."),
             ("chat", "Fix the spelling mistakes in this paragraph and output the whole "
              "corrected paragraph:\n\n" + PARAGRAPH + " " + PASSAGE.replace("allocated",
                                                                                "alocated"))],
    "quotes": [("chat", "Summarize this passage in two sentences, quoting its most important "
                "sentence word for word:\n\n" + PASSAGE)],
    "free": [("chat", f"Write a short story about {topic}.")
             for topic in ("a lighthouse keeper", "a lost kite", "the first snow")],
}


def side_config(side: str, k: int) -> dict | None:
    """A side's speculative_config: none, ngram or suffix ("-sync": the same without
    asynchronous scheduling; "@N": speculation_backoff_steps N, e.g. ngram@8)."""
    side, _, backoff = side.removesuffix("-sync").partition("@")
    extra = {"speculation_backoff_steps": int(backoff)} if backoff else {}
    if side == "none":
        return None
    if side == "ngram":
        return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2,
                "prompt_lookup_max": 5, **extra}
    return {"method": "suffix", "num_speculative_tokens": k, **extra}


def prompt_ids(llm: LLM, kind: str, text: str) -> list[int]:
    tok = llm.get_tokenizer()
    if kind == "raw":
        return tok.encode(text)
    return list(tok.apply_chat_template([{"role": "user", "content": text}],
                                        add_generation_prompt=True, return_dict=False))


def ideal_acceptance(prompts: list[list[int]], outputs: list[list[int]], k: int) -> float:
    """Mean tokens a verify step would emit if prompt lookup (min 2, max 5) ran over the
    greedy output: each step proposes from the tokens so far and emits the matching prefix of
    its draft plus one token."""
    proposer = NgramProposer(2, 5, k)
    steps = emitted = 0
    for prompt, output in zip(prompts, outputs, strict=True):
        t = 0
        while t < len(output):
            draft = proposer.propose("r", prompt + output[:t], k)
            match = 0
            while match < len(draft) and t + match < len(output) and \
                    draft[match] == output[t + match]:
                match += 1
            n = min(match + 1, len(output) - t)
            steps, emitted, t = steps + 1, emitted + n, t + n
    return emitted / steps if steps else float("nan")


def run_set(llm: LLM, ids: list[list[int]], batch: int, params: SamplingParams
            ) -> tuple[float, list[list[int]], dict]:
    """(output tokens/s, the outputs of the set's prompts, the metrics' change)."""
    before = llm.get_metrics()
    t0 = time.perf_counter()
    if batch == 1:
        outs = [llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0] for p in ids]
    else:
        requests = [{"prompt_token_ids": ids[i % len(ids)]} for i in range(batch)]
        outs = llm.generate(requests, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    after = llm.get_metrics()
    delta = {key: after[key] - before[key] for key in
             ("spec_decode_num_drafts", "spec_decode_num_accepted_tokens",
              "spec_decode_num_draft_tokens")}
    tokens = [o.outputs[0].token_ids for o in outs]
    return sum(len(t) for t in tokens) / elapsed, tokens[:len(ids)], delta


class LlamaServer:
    """llama.cpp's server on the same GGUF, driven one request at a time over HTTP."""

    def __init__(self, binary: str, gguf: str, extra: str, threads: int, port: int = 8089):
        self.url = f"http://127.0.0.1:{port}"
        self.proc = subprocess.Popen([binary, "-m", gguf, "-t", str(threads), "--port",
                                      str(port), *extra.split()],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                urllib.request.urlopen(self.url + "/health", timeout=1).read()
                return
            except OSError:
                time.sleep(0.5)
        self.close()
        raise RuntimeError("llama-server did not come up within 120 s")

    def tokens_per_s(self, ids: list[list[int]], max_tokens: int) -> float:
        tokens, t0 = 0, time.perf_counter()
        for prompt in ids:
            body = json.dumps({"prompt": prompt, "n_predict": max_tokens, "temperature": 0,
                               "cache_prompt": False}).encode()
            request = urllib.request.Request(self.url + "/completion", body,
                                             {"Content-Type": "application/json"})
            reply = json.loads(urllib.request.urlopen(request, timeout=600).read())
            tokens += reply.get("tokens_predicted", 0)
        return tokens / (time.perf_counter() - t0)

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--sets", default=",".join(SETS))
    parser.add_argument("--sides", default="none,ngram,suffix")
    parser.add_argument("--batch", default="1,32")
    parser.add_argument("--llama-server", default=None)
    parser.add_argument("--llama-gguf", default=None)
    parser.add_argument("--llama-args", default="")
    args = parser.parse_args()
    sides, sets = args.sides.split(","), args.sets.split(",")
    batches = [int(b) for b in args.batch.split(",")]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    engines = {side: LLM(args.model, dtype=args.dtype, max_model_len=2048, max_num_seqs=32,
                         speculative_config=side_config(side, args.k),
                         async_scheduling=not side.endswith("-sync")) for side in sides}
    ids = {name: [prompt_ids(engines[sides[0]], kind, text) for kind, text in SETS[name]]
           for name in sets}
    llama = None
    if args.llama_server:
        llama = LlamaServer(args.llama_server, args.llama_gguf, args.llama_args,
                            int(os.environ.get("OMP_NUM_THREADS", os.cpu_count() or 1)))
    samples, outputs = Rounds(), {}
    try:
        # Warm-up: every prompt once per engine (a first prefill of a new length took ~4x the
        # steady one, which a 2-round median would keep in its first round).
        for llm in engines.values():
            llm.generate([{"prompt_token_ids": p} for name in sets for p in ids[name]],
                         SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
        for r in range(args.rounds):
            for name in sets:
                for batch in batches:
                    for side in rotated(sides, r):
                        tps, outs, delta = run_set(engines[side], ids[name], batch, params)
                        samples.add((name, batch, side), tps)
                        drafts = delta["spec_decode_num_drafts"]
                        if drafts:
                            samples.add((name, batch, side, "len"),
                                        1 + delta["spec_decode_num_accepted_tokens"] / drafts)
                        if side == "none":
                            outputs[name] = outs
                    if llama is not None and batch == 1:
                        samples.add((name, 1, "llama.cpp"),
                                    llama.tokens_per_s(ids[name], args.max_tokens))
            print(f"round {r + 1}/{args.rounds} done", flush=True)
    finally:
        for llm in engines.values():
            llm.shutdown()
        if llama is not None:
            llama.close()
    report(samples, outputs, ids, sets, batches, sides, args, llama is not None)


def report(samples: Rounds, outputs: dict, ids: dict, sets: list[str], batches: list[int],
           sides: list[str], args: argparse.Namespace, with_llama: bool) -> None:
    print(f"\nmodel={args.model or 'default'} dtype={args.dtype} k={args.k} "
          f"max_tokens={args.max_tokens}, {args.rounds} rounds (medians of per-round ratios)")
    print("| set | batch | side | tok/s | / none | range | mean acceptance length | ideal |")
    print("|---|---|---|---|---|---|---|---|")
    for name in sets:
        ideal = ideal_acceptance(ids[name], outputs.get(name, []), args.k) \
            if name in outputs else float("nan")
        for batch in batches:
            rows = sides + (["llama.cpp"] if with_llama and batch == 1 else [])
            for side in rows:
                key = (name, batch, side)
                ratios = samples.ratios(key, (name, batch, "none")) if "none" in sides else []
                length = samples.median((*key, "len"))
                print(f"| {name} | {batch} | {side} | {samples.median(key):.1f} | "
                      f"{median_or_nan(ratios):.2f}x | {spread(ratios)} | "
                      f"{length:.2f} | {ideal:.2f} |")


if __name__ == "__main__":
    main()
