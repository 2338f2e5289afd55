"""The OpenAI API of `shardserve serve` through the official client, against offline LLM."""

from __future__ import annotations

import asyncio
import re
from collections import Counter

import httpx
import openai
import pytest
from server_helpers import API_KEY

from shardserve import SamplingParams

PROMPTS = [
    "The quick brown fox",
    "def add(a, b):",
    "Hello, world! How are",
    "The engine schedules requests",
]


def offline(llm, prompts, **kw):
    params = SamplingParams(temperature=0, **kw)
    return llm.generate(prompts, params, use_tqdm=False)


def model_name(server) -> str:
    return httpx.get(f"{server.url}/v1/models", headers=server.headers).json()["data"][0]["id"]


def test_completions_greedy_equal_offline(client, tiny_server, tiny_offline):
    expected = offline(tiny_offline, PROMPTS, max_tokens=24)
    name = model_name(tiny_server)
    for prompt, ref in zip(PROMPTS, expected, strict=True):
        resp = client.completions.create(model=name, prompt=prompt, max_tokens=24, temperature=0)
        choice = resp.choices[0]
        assert choice.text == ref.outputs[0].text
        assert choice.finish_reason == ref.outputs[0].finish_reason
        assert resp.usage.prompt_tokens == len(ref.prompt_token_ids)
        assert resp.usage.completion_tokens == len(ref.outputs[0].token_ids)
    # A list of prompts: one choice each, in order.
    resp = client.completions.create(model=name, prompt=PROMPTS, max_tokens=24, temperature=0)
    assert [c.index for c in resp.choices] == list(range(len(PROMPTS)))
    assert [c.text for c in resp.choices] == [r.outputs[0].text for r in expected]
    # Token ids as the prompt.
    ids = expected[0].prompt_token_ids
    resp = client.completions.create(model=name, prompt=ids, max_tokens=24, temperature=0)
    assert resp.choices[0].text == expected[0].outputs[0].text


def test_completions_streaming_equal_offline(client, tiny_server, tiny_offline):
    expected = offline(tiny_offline, PROMPTS[:2], max_tokens=20)
    for prompt, ref in zip(PROMPTS[:2], expected, strict=True):
        stream = client.completions.create(
            model=model_name(tiny_server), prompt=prompt, max_tokens=20, temperature=0,
            stream=True, stream_options={"include_usage": True})
        chunks = list(stream)
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        assert text == ref.outputs[0].text
        finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
        assert finishes[-1] == ref.outputs[0].finish_reason and not any(finishes[:-1])
        assert chunks[-1].usage.completion_tokens == len(ref.outputs[0].token_ids)


def test_chat_equal_offline(client, tiny_server, tiny_offline):
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Tell me about the lazy dog."}]
    ref = tiny_offline.chat(messages, SamplingParams(temperature=0, max_tokens=20),
                            use_tqdm=False)[0]
    resp = client.chat.completions.create(model=model_name(tiny_server), messages=messages,
                                          max_completion_tokens=20, temperature=0)
    assert resp.choices[0].message.content == ref.outputs[0].text
    assert resp.choices[0].message.role == "assistant"
    assert resp.usage.prompt_tokens == len(ref.prompt_token_ids)
    stream = client.chat.completions.create(model=model_name(tiny_server), messages=messages,
                                            max_tokens=20, temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ref.outputs[0].text
    assert chunks[-1].choices[0].finish_reason == ref.outputs[0].finish_reason


def test_n_seed_penalties(client, tiny_server, tiny_offline):
    kw = dict(n=3, temperature=1.0, seed=7, presence_penalty=0.5, frequency_penalty=0.3,
              top_p=0.9)
    ref = tiny_offline.generate([PROMPTS[1]], SamplingParams(max_tokens=12, **kw),
                                use_tqdm=False)[0]
    resp = client.completions.create(model=model_name(tiny_server), prompt=PROMPTS[1],
                                     max_tokens=12, user="someone", **kw)
    assert sorted(c.index for c in resp.choices) == [0, 1, 2]
    by_index = {c.index: c.text for c in resp.choices}
    assert [by_index[i] for i in range(3)] == [o.text for o in ref.outputs]
    assert resp.usage.completion_tokens == sum(len(o.token_ids) for o in ref.outputs)


def test_stop_strings_streamed_and_not(client, tiny_server, tiny_offline):
    full = offline(tiny_offline, [PROMPTS[0]], max_tokens=30, ignore_eos=True)[0].outputs[0].text
    stop = full[len(full) // 2: len(full) // 2 + 3]
    assume_stop = full.find(stop)
    name = model_name(tiny_server)
    resp = client.completions.create(model=name, prompt=PROMPTS[0], max_tokens=30,
                                     temperature=0, stop=[stop], extra_body={"ignore_eos": True})
    assert resp.choices[0].text == full[:assume_stop]
    assert resp.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(model=name, prompt=PROMPTS[0], max_tokens=30,
                                            temperature=0, stop=stop, stream=True,
                                            extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks) == full[:assume_stop]


def test_n_choices_each_ended_by_a_stop_string(client, tiny_server, tiny_offline):
    """Each of n sampled choices ends at its own first space; the request finishes (it once ran
    forever: the token of the step under way un-finished a stopped choice) and the next one is
    served."""
    kw = dict(n=3, temperature=1.0, seed=1, stop=[" "])
    ref = tiny_offline.generate([PROMPTS[0]], SamplingParams(max_tokens=20, **kw),
                                use_tqdm=False)[0]
    resp = client.completions.create(model=model_name(tiny_server), prompt=PROMPTS[0],
                                     max_tokens=20, **kw)
    by_index = {c.index: c for c in resp.choices}
    assert [by_index[i].text for i in range(3)] == [o.text for o in ref.outputs]
    assert all(" " not in c.text for c in resp.choices)
    chunks = list(client.completions.create(model=model_name(tiny_server), prompt=PROMPTS[0],
                                            max_tokens=20, stream=True, **kw))
    streamed = {i: "".join(c.choices[0].text for c in chunks if c.choices[0].index == i)
                for i in range(3)}
    assert [streamed[i] for i in range(3)] == [o.text for o in ref.outputs]


def _text(token_id: int, lp) -> str:
    """A token's text as the server shows it (its id where it has no decoded text)."""
    return lp.decoded_token if lp.decoded_token is not None else str(token_id)


def _top(position: dict, k: int) -> list[tuple[str, float]]:
    """An offline position's k most likely (token text, logprob), as the server ranks them."""
    ranked = sorted(position.items(), key=lambda kv: -kv[1].logprob)[:k]
    return [(_text(tid, lp), lp.logprob) for tid, lp in ranked]


def _same_top(got: list[tuple[str, float]], want: list[tuple[str, float]]) -> None:
    """Equal within float noise; the order of (near-)ties may differ, so compare sorted."""
    assert len(got) == len(want), (got, want)
    assert sorted(lp for _, lp in got) == pytest.approx(sorted(lp for _, lp in want), abs=1e-4)
    assert Counter(t for t, _ in got) == Counter(t for t, _ in want), (got, want)


def test_completion_logprobs_equal_offline(client, tiny_server, tiny_offline):
    ref = tiny_offline.generate([PROMPTS[2]], SamplingParams(temperature=0, max_tokens=6,
                                                            logprobs=3), use_tqdm=False)[0]
    out = ref.outputs[0]
    resp = client.completions.create(model=model_name(tiny_server), prompt=PROMPTS[2],
                                     max_tokens=6, temperature=0, logprobs=3)
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == len(out.token_ids) == len(lp.token_logprobs)
    chosen = [out.logprobs[i][t] for i, t in enumerate(out.token_ids)]
    assert lp.tokens == [_text(t, c) for t, c in zip(out.token_ids, chosen, strict=True)]
    assert lp.token_logprobs == pytest.approx([c.logprob for c in chosen], abs=1e-4)
    for got, position in zip(lp.top_logprobs, out.logprobs, strict=True):
        # Keyed by text: tokens that decode alike (partial UTF-8) share a key, and the server
        # keeps one of them; every key must be one of the offline tokens with that text.
        texts = {tid: _text(tid, p) for tid, p in position.items()}
        assert set(got) == set(texts.values())
        for text, value in got.items():
            assert any(value == pytest.approx(p.logprob, abs=1e-4)
                       for tid, p in position.items() if texts[tid] == text), (text, value)


def test_chat_logprobs_equal_offline(client, tiny_server, tiny_offline):
    messages = [{"role": "user", "content": "hi"}]
    ref = tiny_offline.chat(messages, SamplingParams(temperature=0, max_tokens=5, logprobs=2),
                            use_tqdm=False)[0].outputs[0]
    chat = client.chat.completions.create(
        model=model_name(tiny_server), messages=messages, max_tokens=5, temperature=0,
        logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens == len(ref.token_ids)
    for item, token_id, position in zip(content, ref.token_ids, ref.logprobs, strict=True):
        assert item.token == _text(token_id, position[token_id])
        assert item.logprob == pytest.approx(position[token_id].logprob, abs=1e-4)
        _same_top([(t.token, t.logprob) for t in item.top_logprobs], _top(position, 2))


def test_models_health_version_metrics_and_auth(tiny_server):
    url = tiny_server.url
    assert httpx.get(f"{url}/health").status_code == 200  # no key needed
    assert httpx.get(f"{url}/version").json()["version"]
    metrics = httpx.get(f"{url}/metrics").text
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                 "prompt_tokens_total", "generation_tokens_total",
                 "time_to_first_token_seconds_bucket", "inter_token_latency_seconds_bucket",
                 "e2e_request_latency_seconds_bucket", "kv_cache_capacity_tokens"):
        assert f"shardserve:{name}" in metrics, name
    capacity = re.search(r'kv_cache_capacity_tokens\{engine="0"\} (\S+)', metrics)
    assert capacity and float(capacity.group(1)) >= 512  # at least max_model_len, from start-up
    models = httpx.get(f"{url}/v1/models", headers=tiny_server.headers).json()
    assert models["data"][0]["max_model_len"] == 512
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        r = httpx.get(f"{url}/v1/models", headers=headers)
        assert r.status_code == 401 and r.json()["error"]["message"]
    bad = openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=model_name(tiny_server), prompt="x", max_tokens=2)


def test_metrics_count_what_was_served(client, tiny_server):
    """Counters move by exactly what the responses report; each engine request (a prompt, or one
    of its n choices) is one TTFT, one e2e latency and one finish, and every later token one
    inter-token gap (one output per step, one token each: no speculative decoding)."""
    name = model_name(tiny_server)
    eos = {"ignore_eos": True}  # every choice runs to max_tokens: known token counts
    before = tiny_server.metrics()
    usages, tokens_per_engine_request = [], []
    r = client.completions.create(model=name, prompt=PROMPTS[0], max_tokens=7, temperature=0,
                                  extra_body=eos)
    usages.append(r.usage)
    tokens_per_engine_request += [7]
    r = client.completions.create(model=name, prompt=PROMPTS[1], max_tokens=5, n=2, seed=3,
                                  temperature=0.8, extra_body=eos)
    usages.append(r.usage)
    tokens_per_engine_request += [5, 5]
    r = client.completions.create(model=name, prompt=PROMPTS[2:4], max_tokens=4, temperature=0,
                                  extra_body=eos)
    usages.append(r.usage)
    tokens_per_engine_request += [4, 4]
    r = client.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=6, temperature=0, extra_body=eos)
    usages.append(r.usage)
    tokens_per_engine_request += [6]
    chunks = list(client.completions.create(
        model=name, prompt=PROMPTS[3], max_tokens=9, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body=eos))
    usages.append(chunks[-1].usage)
    tokens_per_engine_request += [9]
    after = tiny_server.metrics()

    def delta(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert [u.completion_tokens for u in usages] == [7, 10, 8, 6, 9]
    n_requests = len(tokens_per_engine_request)
    assert delta("shardserve:prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert delta("shardserve:generation_tokens_total") == sum(u.completion_tokens for u in usages)
    assert delta("shardserve:time_to_first_token_seconds_count") == n_requests
    assert delta("shardserve:e2e_request_latency_seconds_count") == n_requests
    assert delta('shardserve:request_success_total{finished_reason="length"}') == n_requests
    assert delta("shardserve:inter_token_latency_seconds_count") == \
        sum(t - 1 for t in tokens_per_engine_request)
    assert delta("shardserve:time_to_first_token_seconds_sum") > 0
    assert delta("shardserve:e2e_request_latency_seconds_sum") >= \
        delta("shardserve:time_to_first_token_seconds_sum")
    # Every request finished: nothing is left running or holding KV blocks.
    assert after['shardserve:num_requests_running{engine="0"}'] == 0
    assert after['shardserve:kv_cache_usage_perc{engine="0"}'] == 0


def test_32_concurrent_streams(tiny_server, tiny_offline):
    prompts = [f"{PROMPTS[i % 4]} {i}" for i in range(32)]
    expected = [r.outputs[0].text for r in offline(tiny_offline, prompts, max_tokens=32)]
    name = model_name(tiny_server)

    async def one(client: openai.AsyncOpenAI, prompt: str) -> str:
        stream = await client.completions.create(model=name, prompt=prompt, max_tokens=32,
                                                 temperature=0, stream=True)
        return "".join([c.choices[0].text async for c in stream])

    async def run() -> list[str]:
        async with openai.AsyncOpenAI(base_url=f"{tiny_server.url}/v1", api_key=API_KEY,
                                      max_retries=0, timeout=120) as client:
            return await asyncio.wait_for(
                asyncio.gather(*(one(client, p) for p in prompts)), 120)

    assert asyncio.run(run()) == expected
