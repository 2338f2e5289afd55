"""Tool calls through the official client: a named function and `required` are enforced by
structured outputs (their arguments always parse and match the function's schema, even from a
random model), `auto` parses the Hermes format, streamed calls arrive in OpenAI's delta format,
and malformed tools or choices are a 400."""

from __future__ import annotations

import json

import openai
import pytest
from test_server_api import model_name

from shardserve.entrypoints.server.protocol import ServerError
from shardserve.entrypoints.server.tool_calls import parse_hermes, tool_mode

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "days"],
           "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                          "days": {"type": "integer", "minimum": 1, "maximum": 7}}}
TIME = {"type": "object", "additionalProperties": False, "required": ["zone"],
        "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
USER = [{"role": "user", "content": "What is the weather in Paris?"}]


def _valid(name: str, arguments: str) -> bool:
    args = json.loads(arguments)
    if name == "get_weather":
        return set(args) == {"city", "days"} and args["city"] in ("Paris", "Rome") \
            and 1 <= args["days"] <= 7
    return name == "get_time" and args == {"zone": args.get("zone")} \
        and args["zone"] in ("UTC", "CET")


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_named_function_is_always_called_with_valid_arguments(client, tiny_server, seed):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    resp = client.chat.completions.create(model=model_name(tiny_server), messages=USER,
                                          tools=TOOLS, tool_choice=choice, seed=seed,
                                          max_tokens=60)
    message = resp.choices[0].message
    assert resp.choices[0].finish_reason == "stop"
    assert [c.function.name for c in message.tool_calls] == ["get_weather"]
    assert _valid("get_weather", message.tool_calls[0].function.arguments)
    assert message.tool_calls[0].id.startswith("chatcmpl-tool-")


def test_required_makes_at_least_one_valid_call(client, tiny_server):
    resp = client.chat.completions.create(model=model_name(tiny_server), messages=USER,
                                          tools=TOOLS, tool_choice="required", seed=5,
                                          parallel_tool_calls=False, max_tokens=80)
    calls = resp.choices[0].message.tool_calls
    assert resp.choices[0].finish_reason == "tool_calls" and len(calls) == 1
    assert _valid(calls[0].function.name, calls[0].function.arguments)


def test_auto_parses_a_hermes_tool_call(client, tiny_server):
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "days": 3}}\n' \
           '</tool_call>'
    resp = client.chat.completions.create(  # the output forced to a Hermes call
        model=model_name(tiny_server), messages=USER, tools=TOOLS, tool_choice="auto",
        max_tokens=200, extra_body={"structured_outputs": {"choice": [text]}})
    message = resp.choices[0].message
    assert resp.choices[0].finish_reason == "tool_calls" and message.content is None
    assert message.tool_calls[0].function.name == "get_weather"
    assert json.loads(message.tool_calls[0].function.arguments) == {"city": "Rome", "days": 3}


def test_a_streamed_tool_call_in_openai_deltas(client, tiny_server):
    choice = {"type": "function", "function": {"name": "get_time"}}
    stream = client.chat.completions.create(model=model_name(tiny_server), messages=USER,
                                            tools=TOOLS, tool_choice=choice, seed=3,
                                            max_tokens=40, stream=True)
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        delta = chunk.choices[0].delta
        for call in delta.tool_calls or []:
            entry = calls.setdefault(call.index, {"name": "", "arguments": ""})
            entry["name"] += call.function.name or ""
            entry["arguments"] += call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "stop" and list(calls) == [0]
    assert calls[0]["name"] == "get_time" and _valid("get_time", calls[0]["arguments"])


def test_hermes_parser_keeps_the_content_and_skips_broken_blocks():
    content, calls = parse_hermes('Let me check. <tool_call>{"name": "f", "arguments": '
                                  '{"a": 1}}</tool_call> <tool_call>{broken</tool_call>')
    assert content == "Let me check.  <tool_call>{broken</tool_call>"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] \
        == [("f", {"a": 1})]
    assert parse_hermes("plain text") == ("plain text", [])


@pytest.mark.parametrize(("tools", "choice", "parser", "words"), [
    (TOOLS, "auto", None, ["--enable-auto-tool-choice"]),
    (TOOLS, {"type": "function", "function": {"name": "nope"}}, "hermes", ["'nope'"]),
    (None, "required", "hermes", ["needs tools"]),
    ([{"type": "function"}], "required", "hermes", ["tools[0]"]),
    (TOOLS, "sometimes", "hermes", ["tool_choice must be"]),
])
def test_malformed_tools_are_refused(tools, choice, parser, words):
    with pytest.raises(ServerError) as info:
        tool_mode(tools, choice, parser)
    assert info.value.status == 400 and all(w in info.value.message for w in words)


def test_unknown_function_is_a_400_through_the_client(client, tiny_server):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=model_name(tiny_server), messages=USER, tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "nope"}})
    assert info.value.body["param"] == "tool_choice"
