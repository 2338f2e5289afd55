"""`make run`: generate from the default model for a few prompts and report tokens/s."""

from __future__ import annotations

import time

from shardserve import LLM, SamplingParams

PROMPTS = [
    "The capital of France is",
    "Write a short poem about the ocean:",
    "def quicksort(arr):",
    "Three tips for staying focused while studying:",
]


def main() -> None:
    t0 = time.perf_counter()
    llm = LLM(max_model_len=1024)
    print(
        f"engine ready in {time.perf_counter() - t0:.1f} s (dtype {llm.config.model_config.dtype})"
    )
    params = SamplingParams(max_tokens=64, temperature=0.7, top_p=0.95, seed=0)
    t0 = time.perf_counter()
    outputs = llm.generate(PROMPTS, params)
    outputs += llm.chat([{"role": "user", "content": "What is a GPU, in one sentence?"}], params)
    elapsed = time.perf_counter() - t0
    n_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    for out in outputs:
        prompt = out.prompt if out.prompt is not None else "(chat)"
        print(f"\n>>> {prompt}\n{out.outputs[0].text.strip()}")
    print(
        f"\n{len(outputs)} requests, {n_tokens} tokens in {elapsed:.2f} s: "
        f"{n_tokens / elapsed:.1f} tokens/s"
    )
    llm.shutdown()


if __name__ == "__main__":
    main()
