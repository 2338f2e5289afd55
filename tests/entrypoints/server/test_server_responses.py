"""/v1/responses (OpenAI's Responses API) through the official client, on the shared tiny server:
the text equals chat's for the same messages, streamed deltas add up to it in the API's event
order, a json_schema text.format always parses, a named function tool makes a function_call
item, and the stateful parts and built-in tools are a 400 naming the field."""

from __future__ import annotations

import json

import openai
import pytest
from test_server_api import model_name
from test_server_tools import WEATHER

USER = "The quick brown fox"
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["ok", "n"],
          "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                           "maximum": 9}}}
TOOLS = [{"type": "function", "name": "get_weather", "parameters": WEATHER}]
TEXT_EVENTS = ["response.created", "response.in_progress", "response.output_item.added",
               "response.content_part.added"]
TEXT_DONE = ["response.output_text.done", "response.content_part.done",
             "response.output_item.done"]


def _chat(client, server, messages, max_tokens=24, **kw):
    resp = client.chat.completions.create(model=model_name(server), messages=messages,
                                          max_tokens=max_tokens, temperature=0, **kw)
    return resp.choices[0], resp.usage


def _create(client, server, **kw):
    kw.setdefault("max_output_tokens", 24)
    kw.setdefault("temperature", 0)
    if "seed" in kw:  # vLLM's extension (as on chat): not among the client's arguments
        kw["extra_body"] = {"seed": kw.pop("seed")}
    return client.responses.create(model=model_name(server), **kw)


def test_greedy_text_equals_chat(client, tiny_server):
    choice, usage = _chat(client, tiny_server, [{"role": "user", "content": USER}])
    resp = _create(client, tiny_server, input=USER, store=False, user="u1",
                   metadata={"k": "v"})
    assert resp.id.startswith("resp_") and resp.object == "response"
    assert resp.model == model_name(tiny_server) and resp.metadata == {"k": "v"}
    [item] = resp.output
    assert item.type == "message" and item.role == "assistant" and item.id.startswith("msg_")
    assert [p.type for p in item.content] == ["output_text"] and item.content[0].annotations == []
    assert resp.output_text == choice.message.content
    assert resp.status == ("incomplete" if choice.finish_reason == "length" else "completed")
    assert (resp.usage.input_tokens, resp.usage.output_tokens, resp.usage.total_tokens) == \
        (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens)
    # The same message as a list of input_text parts.
    parts = [{"role": "user", "content": [{"type": "input_text", "text": USER}]}]
    assert _create(client, tiny_server, input=parts).output_text == resp.output_text


def test_instructions_are_the_system_message(client, tiny_server):
    system = "You answer in one word."
    choice, _ = _chat(client, tiny_server, [{"role": "system", "content": system},
                                            {"role": "user", "content": USER}])
    resp = _create(client, tiny_server, instructions=system, input=USER)
    assert resp.output_text == choice.message.content and resp.instructions == system
    plain = _create(client, tiny_server, input=USER)
    assert plain.usage.input_tokens < resp.usage.input_tokens


def test_max_output_tokens_makes_it_incomplete(client, tiny_server):
    resp = _create(client, tiny_server, input=USER, max_output_tokens=3)
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    assert resp.usage.output_tokens == 3 and resp.output[0].status == "incomplete"
    assert resp.max_output_tokens == 3


def _events(client, server, **kw) -> list:
    return list(_create(client, server, stream=True, **kw))


def _check_text_stream(events: list, final_type: str) -> str:
    types = [e.type for e in events]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert types == [*TEXT_EVENTS, *["response.output_text.delta"] * len(deltas), *TEXT_DONE,
                     final_type], types
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    text = "".join(d.delta for d in deltas)
    assert events[-4].text == text and events[-2].item.content[0].text == text
    assert events[-1].response.output_text == text
    return text


def test_streamed_deltas_join_to_the_text(client, tiny_server):
    whole = _create(client, tiny_server, input=USER)
    events = _events(client, tiny_server, input=USER)
    final = "response.incomplete" if whole.status == "incomplete" else "response.completed"
    assert _check_text_stream(events, final) == whole.output_text
    assert len([e for e in events if e.type == "response.output_text.delta"]) > 1
    assert events[-1].response.usage.output_tokens == whole.usage.output_tokens


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_json_schema_format_always_parses(client, tiny_server, seed):
    fmt = {"format": {"type": "json_schema", "name": "answer", "schema": SCHEMA}}
    resp = _create(client, tiny_server, input="Answer in JSON.", text=fmt, temperature=1.0,
                   seed=seed, max_output_tokens=200)
    assert resp.status == "completed", resp.output_text
    value = json.loads(resp.output_text)
    assert set(value) == {"ok", "n"} and isinstance(value["ok"], bool) and 0 <= value["n"] <= 9
    if seed == 0:  # streamed: the same seeded sample, ending in response.completed
        events = _events(client, tiny_server, input="Answer in JSON.", text=fmt,
                         temperature=1.0, seed=seed, max_output_tokens=200)
        assert _check_text_stream(events, "response.completed") == resp.output_text


def test_a_named_function_tool_makes_a_function_call(client, tiny_server):
    choice = {"type": "function", "name": "get_weather"}
    resp = _create(client, tiny_server, input="Weather in Paris?", tools=TOOLS,
                   tool_choice=choice, temperature=1.0, seed=1, max_output_tokens=60)
    [call] = resp.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id
    args = json.loads(call.arguments)
    assert args["city"] in ("Paris", "Rome") and 1 <= args["days"] <= 7
    events = _events(client, tiny_server, input="Weather in Paris?", tools=TOOLS,
                     tool_choice=choice, temperature=1.0, seed=1, max_output_tokens=60)
    assert [e.type for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    assert events[4].arguments == call.arguments and events[-1].response.output[0].name == \
        "get_weather"


def test_a_tool_conversation_equals_chat(client, tiny_server):
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Rome", "days": 1}'}}
    choice, _ = _chat(client, tiny_server, [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}])
    resp = _create(client, tiny_server, input=[
        {"role": "user", "content": "Weather?"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather",
         "arguments": call["function"]["arguments"]},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}])
    assert resp.output_text == choice.message.content


@pytest.mark.parametrize(("kw", "param"), [
    ({"previous_response_id": "resp_123"}, "previous_response_id"),
    ({"store": True}, "store"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"background": True}, "background"),
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"max_output_tokens": 100000}, "max_output_tokens"),
    ({"tool_choice": {"type": "function", "name": "nope"}, "tools": TOOLS}, "tool_choice"),
])
def test_unsupported_fields_are_a_400_naming_them(client, tiny_server, kw, param):
    kw = {"input": USER, **kw}
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=model_name(tiny_server), **kw)
    assert info.value.body["param"] == param, info.value.body
    assert param.split("[")[0].split(".")[0] in info.value.body["message"]


def test_the_json_validates_strictly_against_the_clients_models(tiny_server):
    """The client builds its models leniently; pydantic's validation checks every required
    field and literal of the body and of each event (text and tool-call streams)."""
    import httpx
    from openai.types.responses import Response, ResponseStreamEvent
    from pydantic import TypeAdapter

    url, headers = f"{tiny_server.url}/v1/responses", tiny_server.headers
    body = {"model": model_name(tiny_server), "input": USER, "max_output_tokens": 8}
    Response.model_validate(httpx.post(url, json=body, headers=headers, timeout=60).json())
    events = TypeAdapter(ResponseStreamEvent)
    tool = {"tools": TOOLS, "tool_choice": {"type": "function", "name": "get_weather"},
            "seed": 1, "max_output_tokens": 60}
    for extra in ({}, tool):
        with httpx.stream("POST", url, json={**body, **extra, "stream": True},
                          headers=headers, timeout=60) as stream:
            lines = [line for line in stream.iter_lines() if line.startswith("data: ")]
        kinds = [events.validate_json(line[len("data: "):]).type for line in lines]
        assert kinds[-1] in ("response.completed", "response.incomplete"), kinds
