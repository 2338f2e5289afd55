"""Context parallelism on mp with chunked prefill: a 2,000-token prompt prefilled in chunks of
256 beside three oracle prompts, a preemption, then the same again from the prefix cache; float32
greedy equals HF transformers (a file of its own: two xdist workers share the suite's time)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from shardserve import LLM, SamplingParams

sys.path.insert(0, str(Path(__file__).parents[1] / "entrypoints"))
from pp_oracle import oracle_prompt_ids  # noqa: E402

LAYOUTS = {
    "pcp2": dict(prefill_context_parallel_size=2),
    "tp3-dcp3": dict(tensor_parallel_size=3, decode_context_parallel_size=3),
    "pcp2-dcp2": dict(prefill_context_parallel_size=2, decode_context_parallel_size=2),
}


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["pcp2", "tp3-dcp3", "pcp2-dcp2"])
def test_long_prompt_chunked_and_preempted(hf_default_greedy, layout):
    """A 2,000-token prompt prefilled in chunks of 256 beside three oracle prompts, in a cache
    too small for all of them at once: one request is preempted and recomputed."""
    blocks = {"pcp2": 132, "tp3-dcp3": 45, "pcp2-dcp2": 66}[layout]  # DCP: blocks of 16 x DCP
    llm = LLM(dtype="float32", max_model_len=2048, distributed_executor_backend="mp",
              max_num_batched_tokens=256, num_blocks_override=blocks,
              **LAYOUTS[layout])  # fmt: skip
    try:
        tok = llm.get_tokenizer()
        long_ids = tok.encode(" ".join(f"item {i} is {i * 7 % 13}." for i in range(300)))[:2000]
        prompts = [long_ids, *oracle_prompt_ids(tok)[:3]]
        params = SamplingParams(max_tokens=32, temperature=0)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert llm.engine.core.scheduler.total_preemptions > 0
        for ids, out in zip(prompts, outs, strict=True):
            assert out.outputs[0].token_ids == hf_default_greedy(ids, 32)
        # Again: the long prompt's blocks come from the prefix cache (virtual blocks with DCP),
        # the rest of it and the short ones are computed anew over them.
        again = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                             use_tqdm=False)
        assert llm.get_metrics()["prefix_cache_hits"] > 0
        assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in outs]
    finally:
        llm.shutdown()
