"""Eight prompts of different lengths, greedy, 24 tokens each: what an engine laid out some
other way (replicas, nodes) must reproduce from a `uni` engine on the same model."""

from __future__ import annotations

from shardserve import LLM, SamplingParams

PROMPTS = [f"prompt number {i}: " + "word " * i for i in range(8)]
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def greedy_tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def uni_greedy_tokens(model: str) -> list[list[int]]:
    llm = LLM(model, dtype="float32", max_model_len=128, seed=0)
    try:
        return greedy_tokens(llm)
    finally:
        llm.shutdown()
