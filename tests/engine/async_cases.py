"""Workloads that asynchronous scheduling must not change, shared by the backend tests.

`run_cases(llm)` runs every case on one engine and returns comparable results; a test runs it with
async_scheduling on and off (and on several backends) and asserts equality. The cases are built
from the synchronous run's own greedy output, so each stop condition (stop token, stop string,
EOS) really fires in the middle of a generation, where an asynchronous engine has a token in
flight past it.
"""

from __future__ import annotations

from typing import Any

from shardserve import LLM, SamplingParams
from shardserve.engine.request import Request

PROMPTS = [
    "The quick brown fox jumps over",
    "def add(a, b):",
    "Hello, world! How are",
    "Tensor parallel inference splits attention heads",
    "The engine schedules requests",
    "A journey of a thousand miles",
]


def _summary(outs: list[Any]) -> list[list[tuple]]:
    return [
        [(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in o.outputs] for o in outs
    ]


def stop_points(llm: LLM) -> tuple[list[list[int]], str]:
    """The greedy tokens of each prompt (24, ignoring EOS), and a text to use as a stop string."""
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    outs = llm.generate(PROMPTS, greedy, use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outs]
    text = outs[0].outputs[0].text
    return tokens, text[len(text) // 2 : len(text) // 2 + 3]


def run_cases(llm: LLM, tokens: list[list[int]], stop_text: str) -> dict[str, Any]:
    """Every case on `llm`; `tokens` and `stop_text` come from stop_points on a sync engine."""
    results: dict[str, Any] = {}
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    results["greedy"] = _summary(llm.generate(PROMPTS, greedy, use_tqdm=False))
    # A stop token that first appears mid-generation in each prompt's greedy output.
    per_prompt = [
        SamplingParams(max_tokens=24, temperature=0, stop_token_ids=[t[len(t) // 2]])
        for t in tokens
    ]
    results["stop_token"] = _summary(llm.generate(PROMPTS, per_prompt, use_tqdm=False))
    # The same token as EOS (ignore_eos=False): the arch's EOS list is fixed, so a stop token
    # with min_tokens tests the EOS-like path that min_tokens guards.
    min_tok = [
        SamplingParams(max_tokens=24, temperature=0, min_tokens=len(t) // 2 + 2,
                       stop_token_ids=[t[len(t) // 2]])
        for t in tokens
    ]  # fmt: skip
    results["min_tokens"] = _summary(llm.generate(PROMPTS, min_tok, use_tqdm=False))
    stop = SamplingParams(max_tokens=24, temperature=0, stop=[stop_text], ignore_eos=True)
    results["stop_string"] = _summary(llm.generate(PROMPTS, stop, use_tqdm=False))
    lengths = [SamplingParams(max_tokens=1 + 3 * i, temperature=0) for i in range(len(PROMPTS))]
    results["max_tokens"] = _summary(llm.generate(PROMPTS, lengths, use_tqdm=False))
    seeded = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, seed=7, n=3)
    results["seeded_n3"] = _summary(llm.generate(PROMPTS[:3], seeded, use_tqdm=False))
    results["eos"] = eos_mid_generation(llm, tokens)
    results["aborts"] = abort_after(llm, k=3)
    return results


def _core_run(llm: LLM, requests: list[Request], on_output=None) -> dict[str, list]:
    """Run requests on the engine core directly: {request id: [tokens, finish reason]}."""
    core = llm.engine.core
    got: dict[str, list] = {}
    for request in requests:
        core.add_request(request)
        got[request.request_id] = [[], None]
    while core.has_unfinished_requests():
        for out in core.step():
            got[out.request_id][0].extend(out.new_token_ids)
            got[out.request_id][1] = out.finish_reason
            if on_output is not None:
                on_output(core, out, got[out.request_id][0])
    return got


def eos_mid_generation(llm: LLM, tokens: list[list[int]]) -> dict[str, list]:
    """Each request's EOS is a token its greedy output reaches mid-way (the model's own EOS id
    may never come up, so the engine-core request carries its own eos_token_ids)."""
    params = SamplingParams(max_tokens=24, temperature=0)
    tokenizer = llm.get_tokenizer()
    requests = [
        Request(f"eos-{i}", tokenizer.encode(p), params, eos_token_ids=(t[len(t) // 2],))
        for i, (p, t) in enumerate(zip(PROMPTS, tokens, strict=True))
    ]
    return _core_run(llm, requests)


def abort_after(llm: LLM, k: int) -> dict[str, list[int]]:
    """Abort every odd request as soon as the engine core has reported k tokens for it; the
    tokens each request was given in the end.

    A synchronous engine has produced exactly k tokens at that moment; an asynchronous one has
    one more in flight, which must never be reported.
    """
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    tokenizer = llm.get_tokenizer()
    eos = llm.engine.core.config.model_config.arch.eos_token_ids
    requests = [
        Request(f"abort-{i}", tokenizer.encode(p), params, eos_token_ids=eos)
        for i, p in enumerate(PROMPTS)
    ]

    def maybe_abort(core, out, so_far: list[int]) -> None:
        if int(out.request_id.split("-")[1]) % 2 and len(so_far) == k:
            core.abort_requests([out.request_id])

    return {rid: toks for rid, (toks, _) in _core_run(llm, requests, maybe_abort).items()}
