"""llama.cpp's side of bench/cpu_vs_llamacpp.py, in a process of its own (so it may run from
another virtualenv): loads the GGUF with llama-cpp-python, then answers one JSON command per
stdin line with one JSON line on stdout.

    {"cmd": "decode", "prompt": str, "tokens": int}      -> {"tokens": n, "seconds": s}
    {"cmd": "requests", "prompts": [str], "tokens": int} -> {"tokens": n, "seconds": s}
    {"cmd": "quit"}

`decode` times one greedy completion of `tokens` tokens (EOS banned, so every run decodes the
same count) from its first token on; `requests` runs the prompts one after another (the
library serves one sequence at a time) and times the whole.
"""

from __future__ import annotations

import json
import sys
import time

from llama_cpp import Llama


def complete(llm: Llama, prompt: str, tokens: int, ban: dict[int, float]) -> int:
    out = llm.create_completion(prompt, max_tokens=tokens, temperature=0.0, logit_bias=ban)
    return int(out["usage"]["completion_tokens"])


def decode_rate(llm: Llama, prompt: str, tokens: int, ban: dict[int, float]) -> dict:
    """Tokens after the first and the seconds they took (prefill excluded, like a chat's
    streaming rate)."""
    stream = llm.create_completion(prompt, max_tokens=tokens, temperature=0.0, logit_bias=ban,
                                   stream=True)
    first = None
    count = 0
    for _ in stream:
        count += 1
        if first is None:
            first = time.perf_counter()
    assert first is not None
    return {"tokens": count - 1, "seconds": time.perf_counter() - first}


def main() -> None:
    model_path, threads = sys.argv[1], int(sys.argv[2])
    llm = Llama(model_path=model_path, n_ctx=1024, n_threads=threads, n_threads_batch=threads,
                verbose=False)
    ban = {llm.token_eos(): -1e9}
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "quit":
            break
        if cmd["cmd"] == "decode":
            reply = decode_rate(llm, cmd["prompt"], cmd["tokens"], ban)
        else:
            t0 = time.perf_counter()
            n = sum(complete(llm, p, cmd["tokens"], ban) for p in cmd["prompts"])
            reply = {"tokens": n, "seconds": time.perf_counter() - t0}
        print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    main()
