"""use_beam_search on /v1/completions (vLLM's extension) through the official openai client: the n
choices are offline LLM.beam_search's best n (best_of beams, default n); what beam search cannot
honour is a 400 naming it. The session's tiny server and its offline twin."""

from __future__ import annotations

import httpx
import openai
import pytest

from shardserve import BeamSearchParams

PROMPTS = ["The quick brown fox", "def add(a, b):"]


@pytest.fixture(scope="module")
def name(tiny_server) -> str:
    models = httpx.get(f"{tiny_server.url}/v1/models", headers=tiny_server.headers, timeout=30)
    return models.json()["data"][0]["id"]


def offline_choices(llm, prompt: str, n: int, width: int, max_tokens: int
                    ) -> list[tuple[str, str]]:
    """(text, finish_reason) of the best n beams, as the server writes its choices: the
    generated tokens without an ending EOS, special tokens skipped."""
    tok = llm.get_tokenizer()
    prompt_len = len(tok.encode(prompt))
    out = llm.beam_search(prompt, BeamSearchParams(beam_width=width, max_tokens=max_tokens))
    choices = []
    for seq in out[0].sequences[:n]:
        generated = seq.tokens[prompt_len:]
        if seq.finish_reason == "stop":
            generated = generated[:-1]
        choices.append((tok.decode(generated, skip_special_tokens=True), seq.finish_reason))
    return choices


def test_beam_search_choices_equal_offline_top_n(client, name, tiny_offline):
    got = client.completions.create(model=name, prompt=PROMPTS, max_tokens=8, n=2,
                                    temperature=0,
                                    extra_body={"use_beam_search": True, "best_of": 3})
    assert [c.index for c in got.choices] == [0, 1, 2, 3]
    for i, prompt in enumerate(PROMPTS):
        want = offline_choices(tiny_offline, prompt, n=2, width=3, max_tokens=8)
        choices = got.choices[2 * i:2 * i + 2]
        assert [(c.text, c.finish_reason) for c in choices] == want
    # best_of defaults to n: the beam width is n.
    one = client.completions.create(model=name, prompt=PROMPTS[0], max_tokens=6, n=2,
                                    temperature=0, extra_body={"use_beam_search": True})
    assert [(c.text, c.finish_reason) for c in one.choices] == offline_choices(
        tiny_offline, PROMPTS[0], n=2, width=2, max_tokens=6)
    assert one.usage.completion_tokens >= 2


@pytest.mark.parametrize(("endpoint", "extra", "words"), [
    ("completions", {"stream": True}, ["stream"]),
    ("completions", {"best_of": 1, "n": 2}, ["best_of", ">= n (2)"]),
    ("completions", {"best_of": 11}, ["best_of", "beam width", "[1, 10]", "got 11"]),
    ("completions", {"top_p": 0.5}, ["top_p", "use_beam_search"]),
    ("completions", {"logprobs": 2}, ["logprobs", "use_beam_search"]),
    ("chat", {}, ["use_beam_search", "/v1/completions"]),
])
def test_what_beam_search_cannot_honour_is_a_400(client, name, endpoint, extra, words):
    body = {"use_beam_search": True, **extra}
    with pytest.raises(openai.BadRequestError) as info:
        if endpoint == "chat":
            client.chat.completions.create(model=name, max_tokens=4, extra_body=body,
                                           messages=[{"role": "user", "content": "Hi"}])
        else:
            client.completions.create(model=name, prompt=PROMPTS[0], max_tokens=4,
                                      extra_body=body)
    message = info.value.body["message"]
    assert all(w in message for w in words), message


def test_length_penalty_needs_beam_search(client, name):
    with pytest.raises(openai.BadRequestError, match="length_penalty"):
        client.completions.create(model=name, prompt=PROMPTS[0], max_tokens=4,
                                  extra_body={"length_penalty": 0.5})
