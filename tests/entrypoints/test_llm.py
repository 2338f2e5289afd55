"""The offline API end to end on the default model: batching, sampling, bad input, sleep."""

from __future__ import annotations

import pytest

from shardserve import LLM, SamplingParams

WORDS = "the engine schedules requests and samples tokens from a paged cache of keys and values"


def _prompts(n: int) -> list[str]:
    """n prompts of varied lengths (4 to ~60 tokens)."""
    words = WORDS.split()
    return [
        f"Story {i}: " + " ".join(words[: 2 + (i * 7) % len(words)] * (1 + i % 3)) for i in range(n)
    ]


@pytest.fixture(scope="module")
def llm():
    engine = LLM(dtype="float32", max_model_len=512, seed=0)
    yield engine
    engine.shutdown()


def _texts(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.slow
def test_batch_invariance_alone_batched_and_preempted(llm):
    prompts = _prompts(16)
    greedy = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    batched = _texts(llm.generate(prompts, greedy, use_tqdm=False))
    for i in (0, 5, 11):  # alone, a few of them (each costs a full generation)
        assert _texts(llm.generate([prompts[i]], greedy, use_tqdm=False))[0] == batched[i]
    # 12 blocks of 16 tokens cannot hold 16 requests of ~20-80 tokens: preemption and recompute;
    # a 24-token budget splits every long prompt into chunks.
    tiny = LLM(
        dtype="float32",
        max_model_len=160,
        num_blocks_override=12,
        max_num_batched_tokens=24,
        seed=0,
    )
    try:
        squeezed = tiny.generate(prompts, greedy, use_tqdm=False)
        assert _texts(squeezed) == batched
        scheduler = tiny.engine.core.scheduler
        assert scheduler.total_preemptions > 0
        assert scheduler.kv.num_free_blocks == 12  # every block came back
    finally:
        tiny.shutdown()


@pytest.mark.slow
def test_seeded_sampling_is_reproducible_whatever_the_batch(llm):
    prompt = "My favourite animal is"
    seeded = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.95, seed=1234)
    alone = llm.generate([prompt], seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = [SamplingParams(max_tokens=8, temperature=0.8, seed=s) for s in range(5)]
    mixed = llm.generate([prompt] + _prompts(5), [seeded] + others, use_tqdm=False)
    assert mixed[0].outputs[0].token_ids == alone
    other_seed = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.95, seed=99)
    assert llm.generate([prompt], other_seed, use_tqdm=False)[0].outputs[0].token_ids != alone


def test_n_stop_strings_logprobs_and_token_prompts(llm):
    params = SamplingParams(n=3, max_tokens=8, temperature=1.0, seed=7)
    out = llm.generate("The weather today is", params, use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # distinct seeds per sequence

    greedy = llm.generate("The capital of France is", SamplingParams(max_tokens=16, temperature=0))
    text = greedy[0].outputs[0].text
    stop_word = text.split()[1]
    stopped = llm.generate(
        "The capital of France is",
        SamplingParams(max_tokens=16, temperature=0, stop=[stop_word]),
        use_tqdm=False,
    )[0].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop_word
    assert stopped.text == text[: text.index(stop_word)]

    lp = llm.generate([[504, 3575, 282]], SamplingParams(max_tokens=4, logprobs=3, temperature=0))
    completion = lp[0].outputs[0]
    assert lp[0].prompt_token_ids == [504, 3575, 282]
    for token, entry in zip(completion.token_ids, completion.logprobs, strict=True):
        assert entry[token].rank == 1 and len(entry) == 3  # greedy: the sampled token is the top
        assert all(v.logprob <= 0 for v in entry.values())


def test_chat_applies_template(llm):
    out = llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=8, temperature=0))
    tok = llm.get_tokenizer()
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, return_dict=False
    )
    assert out[0].prompt_token_ids == list(ids)
    assert out[0].outputs[0].text


@pytest.mark.parametrize(
    ("prompt", "params", "words"),
    [
        ("", SamplingParams(), ["empty"]),
        ("x " * 600, SamplingParams(), ["max_model_len=512"]),
        ([[1, 10**9]], SamplingParams(), ["vocabulary", "1000000000"]),
        ({"foo": 1}, SamplingParams(), ["prompt"]),
    ],
)
def test_bad_prompts_are_rejected_and_the_engine_keeps_serving(llm, prompt, params, words):
    with pytest.raises(ValueError) as err:
        llm.generate(prompt if isinstance(prompt, list) else [prompt], params, use_tqdm=False)
    for word in words:
        assert word in str(err.value)
    out = llm.generate("Hello", SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"n": 0}, "n"),
    ],
)
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"model": "/nonexistent/model"}, ["/nonexistent/model"]),
        ({"dtype": "int3"}, ["int3", "float32"]),
        ({"max_model_len": 10**6}, ["max_model_len", "8192"]),
        ({"tensor_parallel_size": 2, "distributed_executor_backend": "uni"}, ["uni"]),
        ({"tensor_parallel_size": 2, "distributed_executor_backend": "mp"}, ["1, 3"]),
        ({"distributed_executor_backend": "warp"}, ["warp", "mp"]),
        ({"no_such_option": 1}, ["no_such_option", "max_num_seqs"]),
    ],
)
def test_bad_engine_options_are_clear(kwargs, words):
    with pytest.raises((ValueError, TypeError)) as err:
        LLM(**kwargs)
    for word in words:
        assert word in str(err.value)


@pytest.mark.slow
@pytest.mark.parametrize("level", [1, 2])
def test_sleep_and_wake_up_keep_outputs(llm, level):
    params = SamplingParams(max_tokens=8, temperature=0)
    before = llm.generate("Sleep well,", params, use_tqdm=False)[0].outputs[0].token_ids
    llm.sleep(level)
    runner = llm.engine.core.executor.worker.model_runner
    assert runner.kv_caches is None
    assert (runner.model is None) == (level == 2)
    llm.wake_up()
    after = llm.generate("Sleep well,", params, use_tqdm=False)[0].outputs[0].token_ids
    assert after == before
