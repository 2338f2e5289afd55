"""Structured outputs through the official client: response_format (json_schema, json_object)
and vLLM's structured_outputs field, streamed and not, equal to offline with the same
constraint; malformed constraints are a 400 naming the field, and the server serves on."""

from __future__ import annotations

import json
import re

import openai
import pytest
from test_server_api import model_name

from shardserve import SamplingParams
from shardserve.sampling_params import StructuredOutputsParams as S

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["n", "ok"],
          "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                         "ok": {"type": "boolean"}}}


def _offline(llm, prompt: str, spec: S, max_tokens: int, **kw) -> str:
    params = SamplingParams(max_tokens=max_tokens, structured_outputs=spec, **kw)
    return llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].text


def test_json_schema_response_format_equals_offline(client, tiny_server, tiny_offline):
    # Seeded sampling: greedy, the random model would pick free whitespace for ever.
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
    resp = client.completions.create(model=model_name(tiny_server), prompt="Hi", max_tokens=60,
                                     seed=3, extra_body={"response_format": fmt})
    text = resp.choices[0].text
    assert resp.choices[0].finish_reason == "stop", text
    value = json.loads(text)
    assert set(value) == {"n", "ok"} and 0 <= value["n"] <= 99
    assert text == _offline(tiny_offline, "Hi", S(json=SCHEMA), 60, seed=3)


def test_structured_outputs_field_streamed(client, tiny_server, tiny_offline):
    body = {"structured_outputs": {"regex": r"[ab]{3}-[0-9]{2}"}}
    stream = client.chat.completions.create(
        model=model_name(tiny_server), messages=[{"role": "user", "content": "code?"}],
        max_tokens=20, temperature=0, stream=True, extra_body=body)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert re.fullmatch(r"[ab]{3}-[0-9]{2}", text), text
    choice = client.completions.create(model=model_name(tiny_server), prompt="pick", max_tokens=8,
                                       extra_body={"structured_outputs": {"choice": ["x", "y"]}})
    assert choice.choices[0].text in ("x", "y")


@pytest.mark.parametrize(("extra", "param", "words"), [
    ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs", ["regex", "parenthesis"]),
    ({"structured_outputs": {"json": {"type": "objectx"}}}, "structured_outputs", ["objectx"]),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs",
     ["exactly one"]),
    ({"structured_outputs": {"regexp": "a"}}, "structured_outputs:", ["regexp"]),
    ({"response_format": {"type": "xml"}}, "response_format.type", ["xml"]),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema.schema",
     ["schema"]),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
     "response_format", ["both"]),
])
def test_a_bad_constraint_is_a_400_naming_it(client, tiny_server, extra, param, words):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model_name(tiny_server), prompt="x", max_tokens=4,
                                  extra_body=extra)
    error = info.value.body
    assert error["param"] == param, error
    assert all(w in error["message"] for w in words), error
    ok = client.completions.create(model=model_name(tiny_server), prompt="x", max_tokens=4)
    assert ok.choices[0].finish_reason == "length"


def test_prompt_logprobs_equal_offline(tiny_server, tiny_offline):
    """vLLM's prompt_logprobs field: per prompt token None (the first) or id → logprob, as the
    offline engine computes them; refused on a stream."""
    import httpx

    body = {"model": model_name(tiny_server), "prompt": "The quick brown fox", "max_tokens": 2,
            "temperature": 0, "prompt_logprobs": 2}
    resp = httpx.post(f"{tiny_server.url}/v1/completions", json=body,
                      headers=tiny_server.headers, timeout=60).json()
    got = resp["choices"][0]["prompt_logprobs"]
    want = tiny_offline.generate(["The quick brown fox"], SamplingParams(
        temperature=0, max_tokens=2, prompt_logprobs=2), use_tqdm=False)[0].prompt_logprobs
    assert got[0] is None and len(got) == len(want)
    for g, w in zip(got[1:], want[1:], strict=True):
        assert {int(t): v["logprob"] for t, v in g.items()} == pytest.approx(
            {t: lp.logprob for t, lp in w.items()}, abs=1e-5)
    chat = httpx.post(f"{tiny_server.url}/v1/chat/completions", headers=tiny_server.headers,
                      timeout=60, json={"messages": [{"role": "user", "content": "hi"}],
                                        "max_tokens": 2, "prompt_logprobs": 0}).json()
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) > 2
    streamed = httpx.post(f"{tiny_server.url}/v1/completions", headers=tiny_server.headers,
                          timeout=60, json={**body, "stream": True})
    assert streamed.status_code == 400 and "prompt_logprobs" in streamed.text


@pytest.mark.parametrize(("extra", "param", "words"), [
    ({"return_tokens_as_token_ids": True}, "return_tokens_as_token_ids", ["not supported"]),
    ({"guided_json": {"type": "object"}}, "guided_json", ["structured_outputs", "json"]),
    ({"logits_processors": ["x"]}, "logits_processors", ["not supported"]),
    ({"add_special_tokens": False}, "add_special_tokens", ["add_special_tokens=false"]),
])
def test_defined_but_unimplemented_fields_are_a_400(client, tiny_server, extra, param, words):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model_name(tiny_server), prompt="x", max_tokens=2,
                                  extra_body=extra)
    error = info.value.body
    assert error["param"] == param and all(w in error["message"] for w in words), error


def test_neutral_values_pass_and_unknown_fields_are_logged(client, tiny_server):
    ok = client.completions.create(model=model_name(tiny_server), prompt="x", max_tokens=2,
                                   extra_body={"use_beam_search": False, "priority": 0,
                                               "no_such_field_xyz": 1})
    assert ok.choices[0].finish_reason == "length"
    assert "ignored request fields that neither OpenAI nor vLLM define: no_such_field_xyz" \
        in tiny_server.log()


def test_chat_continue_final_message(client, tiny_server):
    import httpx

    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure"}]
    body = {"model": model_name(tiny_server), "messages": messages, "max_tokens": 2,
            "add_generation_prompt": False, "continue_final_message": True}
    resp = httpx.post(f"{tiny_server.url}/v1/chat/completions", json=body,
                      headers=tiny_server.headers, timeout=60)
    assert resp.status_code == 200, resp.text
    both = httpx.post(f"{tiny_server.url}/v1/chat/completions", headers=tiny_server.headers,
                      timeout=60, json={**body, "add_generation_prompt": True})
    assert both.status_code == 400 and "continue_final_message" in both.text


def test_prefix_cache_counters_in_metrics(client, tiny_server):
    """The second request with the same long prompt reuses its blocks: /metrics counts it."""
    before = (tiny_server.metric("shardserve:prefix_cache_queries_total", 0.0),
              tiny_server.metric("shardserve:prefix_cache_hits_total", 0.0))
    prompt = "The same long prompt, repeated to fill several blocks. " * 6
    for _ in range(2):
        client.completions.create(model=model_name(tiny_server), prompt=prompt, max_tokens=2)
    queries = tiny_server.metric("shardserve:prefix_cache_queries_total") - before[0]
    hits = tiny_server.metric("shardserve:prefix_cache_hits_total") - before[1]
    assert queries > 0 and 16 <= hits < queries, (queries, hits)
