"""Context parallelism on mp with chunked prefill: a 2,000-token prompt (600 with DCP too)
prefilled in chunks of 256 beside the oracle prompts, a preemption, then the same again from
the prefix cache; float32 greedy equals HF transformers (a file of its own: the xdist workers
share the suite's time)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from shardserve import LLM, SamplingParams

sys.path.insert(0, str(Path(__file__).parents[1] / "entrypoints"))
from pp_oracle import oracle_prompt_ids  # noqa: E402

# layout -> (options, prompt tokens, max_model_len, cache blocks: a block holds 16 x DCP tokens).
# PCP=2 takes the 2,000 tokens with all 8 oracle prompts (its 8-prompt HF check);
# PCP=2 x DCP=2 (the split and the sharded cache at once) 600 and 3 of them, enough for 3
# chunks and a preemption at a fraction of the suite's time. DCP within TP at chunk
# boundaries runs the same shard kernel (unit-tested on prefill chunks over shards) and is on
# the oracle prompts in test_context_parallel_mp.py.
LAYOUTS = {
    "pcp2-sync": (dict(prefill_context_parallel_size=2, async_scheduling=False), 2000, 2048, 136),
    "pcp2-dcp2": (dict(prefill_context_parallel_size=2, decode_context_parallel_size=2),
                  600, 704, 22),
}


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_long_prompt_chunked_and_preempted(hf_default_greedy, layout):
    """A long prompt prefilled in chunks of 256 beside three oracle prompts, in a cache too
    small for all of them at once: one request is preempted and recomputed."""
    options, length, max_len, blocks = LAYOUTS[layout]
    llm = LLM(dtype="float32", max_model_len=max_len, distributed_executor_backend="mp",
              max_num_batched_tokens=256, num_blocks_override=blocks, **options)  # fmt: skip
    try:
        tok = llm.get_tokenizer()
        text = " ".join(f"item {i} is {i * 7 % 13}." for i in range(300))
        long_ids = tok.encode(text)[:length]
        assert len(long_ids) == length
        prompts = [long_ids, *oracle_prompt_ids(tok)[:8 if length == 2000 else 3]]
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
