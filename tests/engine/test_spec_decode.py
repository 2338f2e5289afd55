"""Speculative decoding through the real engine, greedy: outputs token for token those of the
same engine without speculation, with drafts really accepted (so the test cannot pass with
speculation silently off).

One engine with n-gram speculation (k = 5) runs every case at k = 0 (no drafts verified: the
reference), then 1, 3 and 5: the scheduler's cap on drafts per step (`scheduler.spec.k`) is set
between generate calls, the proposer proposing 5 tokens and a step verifying the first k, which
is what an engine built with k verifies (an n-gram draft is the k tokens that followed the
match, so a shorter one is its prefix). The reference's 8 oracle prompts also equal HF's greedy
output, so it is the plain engine's. The same cases then run asynchronously (n-gram and
suffix), on mp TP=3 and on PP=2. (Preemption, sampling and structured outputs, every layout
async on and off: test_spec_decode_backends.py and test_spec_decode_sampling.py, on a tiny
model.)
"""

from __future__ import annotations

import pytest

from shardserve import LLM, SamplingParams
from tests.entrypoints.pp_oracle import oracle_prompt_ids

CODE = '''def scale(values, x):
    result = []
    for v in values:
        result.append(v * x)
    return result
'''
EDIT = ("Rewrite this Python function with the variable x renamed to factor:\n\n```python\n"
        + CODE + "```")
NGRAM = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2,
         "prompt_lookup_max": 5, "max_verify_rows": 0,  # drafts at every width
         "max_batch_for_speculation": 64}
MAX_TOKENS = 24


def code_edit_ids(tok) -> list[int]:
    return list(tok.apply_chat_template([{"role": "user", "content": EDIT}],
                                        add_generation_prompt=True, return_dict=False))


def cases(tok, reference: list[list[int]] | None = None) -> tuple[list, list[SamplingParams]]:
    """The 8 oracle prompts and the code-editing one (greedy, EOS on), then the code-editing
    prompt again ending mid-draft: on a stop token, a stop string and max_tokens values past
    each of the first steps (from `reference`, its greedy output without speculation)."""
    prompts = [*oracle_prompt_ids(tok), code_edit_ids(tok)]
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0)] * len(prompts)
    if reference is None:
        return [{"prompt_token_ids": p} for p in prompts], params
    edit = reference[-1]
    text = tok.decode(edit)
    extra = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0, stop_token_ids=[edit[20]]),
             SamplingParams(max_tokens=MAX_TOKENS, temperature=0,
                            stop=[text[len(text) // 2:len(text) // 2 + 4]]),
             *(SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
               for n in (2, 5, 9, 14))]
    prompts += [prompts[-1]] * len(extra)
    return [{"prompt_token_ids": p} for p in prompts], params + extra


def _summary(outs) -> list[tuple]:
    return [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason)
            for o in outs]


@pytest.fixture(scope="module")
def sync_engine(default_model_path):
    llm = LLM(dtype="float32", max_model_len=512, async_scheduling=False,
              speculative_config=NGRAM)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def reference(sync_engine, hf_default_greedy) -> tuple[list[list[int]], list[tuple]]:
    """The engine at k = 0 (no drafts verified): the base cases' tokens, then every case's
    summary."""
    spec = sync_engine.engine.core.scheduler.spec
    spec.k = 0
    tok = sync_engine.get_tokenizer()
    prompts, params = cases(tok)
    base = [o.outputs[0].token_ids
            for o in sync_engine.generate(prompts, params, use_tqdm=False)]
    assert spec.stats.num_drafts == 0
    for p, tokens in zip(oracle_prompt_ids(tok), base, strict=False):
        # (32: the continuations the other oracle tests keep, so computed once per checkout)
        assert tokens == hf_default_greedy(p, 32)[:len(tokens)]  # up to its EOS
    prompts, params = cases(tok, base)
    return base, _summary(sync_engine.generate(prompts, params, use_tqdm=False))


def _check(llm: LLM, base: list[list[int]], want: list[tuple], ks: tuple[int, ...]) -> None:
    prompts, params = cases(llm.get_tokenizer(), base)
    spec = llm.engine.core.scheduler.spec
    for k in ks:
        spec.k = k
        before = spec.stats.num_accepted_tokens
        got = _summary(llm.generate(prompts, params, use_tqdm=False))
        assert got == want, k
        assert spec.stats.num_accepted_tokens > before, k  # drafts really accepted
        assert not any(spec.stats.accepted_per_pos[k:]), k  # never more than k a step


def test_ngram_greedy_identical_k_1_3_5(sync_engine, reference):
    _check(sync_engine, *reference, ks=(1, 3, 5))
    # The code-editing prompt alone: its own drafts are accepted (the model copies the code).
    stats = sync_engine.engine.core.scheduler.spec.stats
    before = stats.num_accepted_tokens
    prompts, params = cases(sync_engine.get_tokenizer())
    out = sync_engine.generate([prompts[-1]], params[-1], use_tqdm=False)[0].outputs[0]
    assert out.token_ids == reference[0][-1]
    assert stats.num_accepted_tokens - before >= MAX_TOKENS // 4


SUFFIX = {"method": "suffix", "num_speculative_tokens": 5, "max_verify_rows": 0,
          "max_batch_for_speculation": 64}
LAYOUTS = {
    # Two steps in flight: the workers fill the draft slots of a step planned while the
    # request's previous one ran (n-gram, then suffix decoding, which the others do not run).
    "uni-async": ({}, (1, 3, 5)),
    "uni-async-suffix": ({"speculative_config": SUFFIX}, (1, 3, 5)),
    # Every rank proposes and fills its slots; stages wait for their tokens (synchronous here:
    # asynchronous PP on the echo model, test_spec_decode_backends.py).
    "mp-tp3-async": ({"tensor_parallel_size": 3, "distributed_executor_backend": "mp"}, (3,)),
    "mp-pp2-sync": ({"pipeline_parallel_size": 2, "distributed_executor_backend": "mp",
                     "async_scheduling": False}, (3,)),
}


# The default model through mp layouts is `make test-slow`'s (Makefile); uni stays in make test.
@pytest.mark.parametrize("layout", [
    pytest.param(name, marks=pytest.mark.slow) if name.startswith("mp-") else name
    for name in LAYOUTS])
def test_greedy_identical_on_every_layout(reference, layout):
    """The same cases on the default model through the other layouts and the suffix method:
    the outputs of the synchronous engine without drafts."""
    options, ks = LAYOUTS[layout]
    llm = LLM(dtype="float32", max_model_len=512, **{"speculative_config": NGRAM, **options})
    try:
        _check(llm, *reference, ks=ks)
    finally:
        llm.shutdown()
