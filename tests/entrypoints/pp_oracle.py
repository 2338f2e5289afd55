"""The HF oracle's prompts (4 raw, 4 chat; test_llm_oracle.py's too), and the check of the
pipeline tests (mp and Ray alike): the default model's float32 greedy output on them, 32 tokens
each, must equal HF generate's token for token (computed once per checkout: hf_oracle.py)."""

from __future__ import annotations

from collections.abc import Callable

from shardserve import LLM, SamplingParams

RAW_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
]
CHAT_PROMPTS = [
    "What is 2 + 2?",
    "Write a haiku about the sea.",
    "Name three fruits.",
    "Explain gravity in one sentence.",
]
def oracle_prompt_ids(tok) -> list[list[int]]:
    chat = [
        tok.apply_chat_template(
            [{"role": "user", "content": p}], add_generation_prompt=True, return_dict=False
        )
        for p in CHAT_PROMPTS
    ]
    return [tok.encode(p) for p in RAW_PROMPTS] + [list(c) for c in chat]


def assert_matches_hf(llm: LLM, hf_greedy: Callable[[list[int], int], list[int]],
                      n: int = 32) -> None:
    """`hf_greedy`: the `hf_default_greedy` fixture (tests/hf_oracle.py)."""
    tok = llm.get_tokenizer()
    prompt_ids = oracle_prompt_ids(tok)
    params = SamplingParams(max_tokens=n, temperature=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompt_ids], params, use_tqdm=False)
    for ids, out in zip(prompt_ids, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(ids, n), tok.decode(ids)
