"""Logits controls on the server through the official openai client: logit_bias with OpenAI's
string keys, vLLM's allowed_token_ids, bad_words and truncate_prompt_tokens (completions and
chat), and echo with logprobs on /v1/completions. The session's tiny server; the offline
engine with the same options gives the expected outputs."""

from __future__ import annotations

import httpx
import openai
import pytest

from shardserve import SamplingParams

PROMPT = "The quick brown fox"
USER = [{"role": "user", "content": "Hello, world!"}]


@pytest.fixture(scope="module")
def name(tiny_server) -> str:
    models = httpx.get(f"{tiny_server.url}/v1/models", headers=tiny_server.headers, timeout=30)
    return models.json()["data"][0]["id"]


def offline(llm, prompt, **params):
    return llm.generate([prompt], SamplingParams(**params), use_tqdm=False)[0].outputs[0]


def test_logit_bias_with_string_keys_forces_a_token(client, name, tiny_offline):
    tok = tiny_offline.get_tokenizer()
    greedy = offline(tiny_offline, PROMPT, temperature=0, max_tokens=4, ignore_eos=True)
    target = next(t for t in range(10, 300) if t not in greedy.token_ids)
    for temperature in (0.0, 1.0):
        got = client.completions.create(model=name, prompt=PROMPT, max_tokens=4, seed=1,
                                        temperature=temperature,
                                        logit_bias={str(target): 100},
                                        extra_body={"ignore_eos": True})
        assert got.choices[0].text == tok.decode([target] * 4)
    chat = client.chat.completions.create(model=name, messages=USER, max_tokens=3,
                                          temperature=0, logit_bias={str(target): 100},
                                          extra_body={"ignore_eos": True})
    assert chat.choices[0].message.content == tok.decode([target] * 3)


@pytest.mark.parametrize(("bias", "words"), [
    ({"abc": 1}, ["logit_bias", "'abc'"]),
    ({"1000000": 1}, ["logit_bias", "1000000", "vocab size"]),
    ({"5": 250}, ["logit_bias[5]", "[-100, 100]"]),
])
def test_bad_logit_bias_is_a_400_naming_it(client, name, bias, words):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=name, prompt=PROMPT, max_tokens=2, logit_bias=bias)
    error = info.value.body
    assert error["param"] == "logit_bias", error
    assert all(w in error["message"] for w in words), error


def test_allowed_token_ids_and_bad_words_as_offline(client, name, tiny_offline):
    greedy = offline(tiny_offline, PROMPT, temperature=0, max_tokens=6, ignore_eos=True)
    tok = tiny_offline.get_tokenizer()
    word = tok.decode(greedy.token_ids[:2]).strip()
    for extra in ({"allowed_token_ids": [17, 42, 99, 123]}, {"bad_words": [word]}):
        common = dict(temperature=1.0, seed=7, max_tokens=6, ignore_eos=True)
        want = offline(tiny_offline, PROMPT, **common, **extra)
        got = client.completions.create(model=name, prompt=PROMPT, max_tokens=6,
                                        temperature=1.0, seed=7,
                                        extra_body={"ignore_eos": True, **extra})
        assert got.choices[0].text == want.text, extra
    allowed = offline(tiny_offline, PROMPT, temperature=1.0, seed=7, max_tokens=6,
                      allowed_token_ids=[17, 42, 99, 123])
    assert set(allowed.token_ids) <= {17, 42, 99, 123}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=name, messages=USER, max_tokens=2,
                                       extra_body={"allowed_token_ids": [10**6]})
    assert info.value.body["param"] == "allowed_token_ids"
    assert "1000000" in info.value.body["message"]


def test_truncate_prompt_tokens_on_completions_and_chat(client, name, tiny_offline):
    tok = tiny_offline.get_tokenizer()
    ids = tok.encode("The quick brown fox jumps over the lazy dog. Hello, world!")
    want = offline(tiny_offline, ids[-5:], temperature=0, max_tokens=4)
    got = client.completions.create(model=name, prompt=ids, max_tokens=4, temperature=0,
                                    extra_body={"truncate_prompt_tokens": 5})
    assert got.choices[0].text == want.text and got.usage.prompt_tokens == 5
    # Longer than --max-model-len 512: cut to its last 100 tokens instead of refused.
    long = client.completions.create(model=name, prompt=(ids * 60)[:600], max_tokens=2,
                                     extra_body={"truncate_prompt_tokens": 100})
    assert long.usage.prompt_tokens == 100
    chat = client.chat.completions.create(model=name, messages=USER, max_tokens=3,
                                          temperature=0,
                                          extra_body={"truncate_prompt_tokens": 4})
    rendered = tok.apply_chat_template(USER, tokenize=False, add_generation_prompt=True)
    chat_ids = tok.encode(rendered, add_special_tokens=False)[-4:]
    assert chat.usage.prompt_tokens == 4
    assert chat.choices[0].message.content == offline(tiny_offline, chat_ids, temperature=0,
                                                      max_tokens=3).text
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=name, prompt=PROMPT, max_tokens=2,
                                  extra_body={"truncate_prompt_tokens": 0})
    assert info.value.body["param"] == "truncate_prompt_tokens"


def test_echo_with_logprobs_leads_with_the_prompt(client, name, tiny_offline):
    tok = tiny_offline.get_tokenizer()
    ids = tok.encode(PROMPT)
    want = tiny_offline.generate([PROMPT], SamplingParams(temperature=0, max_tokens=3,
                                                          logprobs=2, prompt_logprobs=2),
                                 use_tqdm=False)[0]
    got = client.completions.create(model=name, prompt=PROMPT, max_tokens=3, temperature=0,
                                    echo=True, logprobs=2)
    choice = got.choices[0]
    choice_lp = choice.logprobs
    assert choice.text == PROMPT + want.outputs[0].text
    assert len(choice_lp.tokens) == len(ids) + 3
    assert choice_lp.tokens[0] == tok.decode(ids[:1])
    assert choice_lp.token_logprobs[0] is None and choice_lp.top_logprobs[0] is None
    expected = [want.prompt_logprobs[i][t].logprob for i, t in enumerate(ids) if i > 0]
    expected += [lp[t].logprob for t, lp in zip(want.outputs[0].token_ids,
                                                 want.outputs[0].logprobs, strict=True)]
    assert choice_lp.token_logprobs[1:] == pytest.approx(expected, abs=1e-4)
    assert all(len(top) >= 2 for top in choice_lp.top_logprobs[1:])
    assert choice_lp.text_offset == sorted(choice_lp.text_offset)
    assert "prompt_logprobs" not in (choice.model_extra or {})  # not asked for by the client
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=name, prompt=PROMPT, max_tokens=2, echo=True,
                                  logprobs=1, stream=True)
    assert info.value.body["param"] == "echo"
