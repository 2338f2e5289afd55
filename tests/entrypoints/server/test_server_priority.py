"""vLLM's `priority` request field on completions and chat, through the official openai client on
the session's tiny server (scheduling_policy fcfs, as vLLM's default): 0 is served, any other
value is a 400 naming the field and the flag that enables it, a non-integer a 400 too. (The
priority order itself is tested through the real engine in tests/entrypoints/test_llm_priority.py
and tests/engine/test_scheduler_priority.py.)"""

from __future__ import annotations

import httpx
import openai
import pytest

USER = [{"role": "user", "content": "Hello, world!"}]


@pytest.fixture(scope="module")
def name(tiny_server) -> str:
    models = httpx.get(f"{tiny_server.url}/v1/models", headers=tiny_server.headers, timeout=30)
    return models.json()["data"][0]["id"]


def _create(client, name: str, endpoint: str, priority):
    extra = {"priority": priority}
    if endpoint == "chat":
        return client.chat.completions.create(model=name, messages=USER, max_tokens=2,
                                              extra_body=extra)
    return client.completions.create(model=name, prompt="Hello", max_tokens=2, extra_body=extra)


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_priority_zero_is_served(client, name, endpoint):
    assert len(_create(client, name, endpoint, 0).choices) == 1


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
@pytest.mark.parametrize("priority, words", [
    (3, ["priority=3", "scheduling_policy='fcfs'", "--scheduling-policy priority"]),
    ("high", ["priority"]),
])
def test_other_priorities_are_a_400_naming_it(client, name, endpoint, priority, words):
    with pytest.raises(openai.BadRequestError) as info:
        _create(client, name, endpoint, priority)
    error = info.value.body
    assert "priority" in (error["param"] or "") + error["message"], error
    assert all(w in error["message"] for w in words), error
