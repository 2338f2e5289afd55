"""The /v1/responses request (OpenAI's Responses API, text in / text out) and its translation
into a chat completion request, which the chat path then serves: one tokenizer, template,
structured-output and tool-call path for both endpoints.

    Responses field              chat field
    input (str | items)          messages (a str is one user message)
    instructions                 a system message before them
    max_output_tokens            max_completion_tokens
    text.format json_schema      response_format json_schema
    tools [{type: function, name, parameters}]   tools [{type: function, function: {...}}]
    tool_choice {type: function, name}           tool_choice {type: function, function: {name}}

The API's stateful parts (previous_response_id, store, conversation, background) and built-in
tools need server-side storage or tools this server does not have: each is a 400 naming it
(unless it holds its neutral value), as protocol.py does for chat; a field nobody defines is
ignored with one log line.
"""

from __future__ import annotations

from typing import Any

from pydantic import ConfigDict, field_validator

from shardserve.entrypoints.server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    ServerError,
    _Strict,
)

# Fields the Responses API defines that this server does not implement → their neutral values.
_UNSUPPORTED: dict[str, Any] = {
    "previous_response_id": None, "conversation": None, "store": False, "background": False,
    "prompt": None, "include": None, "reasoning": None, "top_logprobs": None,
    "max_tool_calls": None, "truncation": "disabled", "service_tier": None,
    "context_management": None, "moderation": None, "image": None, "access_programs": None,
    "prompt_cache_options": None, "prompt_cache_retention": None,
    # vLLM's extensions of its own ResponsesRequest
    "priority": 0, "cache_salt": None, "mm_processor_kwargs": None,
    "enable_response_messages": False, "previous_input_messages": None,
}
_WHY = {
    "previous_response_id": "responses are not stored; send the whole conversation as input",
    "conversation": "conversations are not stored; send the whole conversation as input",
    "store": "responses are not stored; send store false",
    "background": "only foreground requests are served; use stream for long outputs",
    "reasoning": "reasoning options are not supported",
}
# Identifiers with no effect on the output (prefix caching needs no key).
_ACCEPTED = {"request_id", "safety_identifier", "prompt_cache_key"}
_TEXT_PARTS = ("input_text", "output_text")
_ROLES = ("user", "system", "assistant", "developer")


class ResponsesRequest(_Strict):
    model_config = ConfigDict(strict=True, extra="allow")
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None  # vLLM's extension, as on chat
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    text: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    user: str | None = None
    metadata: dict[str, str] | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _input_shape(cls, value: Any) -> Any:
        # One readable message instead of pydantic's one per union member.
        if isinstance(value, str) or (isinstance(value, list)
                                      and all(isinstance(v, dict) for v in value)):
            return value
        raise ValueError(f"input must be a string or a list of message objects "
                         f"(got {repr(value)[:60]})")

    def check_supported(self) -> list[str]:
        """400 for a defined field this server does not implement; returns the names of the
        fields nobody defines (the caller logs them)."""
        extra = dict(self.model_extra or {})
        for name, neutral in _UNSUPPORTED.items():
            value = extra.get(name)
            if value not in (neutral, None) and value != [] and value != {}:
                why = _WHY.get(name, "it is not supported by this server")
                raise ServerError(400, f"{name}={value!r} is not supported: {why}", name)
        if self.stream_options is not None and not self.stream:
            raise ServerError(400, "stream_options is only allowed when stream is true",
                              "stream_options")
        if isinstance(self.input, list) and not self.input:
            raise ServerError(400, "input must not be an empty list", "input")
        return sorted(set(extra) - set(_UNSUPPORTED) - _ACCEPTED)

    def as_chat(self) -> ChatCompletionRequest:
        """The chat completion request that serves this one (400s name Responses' fields)."""
        messages = [ChatMessage(role="system", content=self.instructions)] \
            if self.instructions is not None else []
        messages += _messages(self.input)
        return ChatCompletionRequest(
            model=self.model, messages=messages, max_completion_tokens=self.max_output_tokens,
            temperature=self.temperature, top_p=self.top_p, seed=self.seed, stream=self.stream,
            user=self.user, response_format=_response_format(self.text),
            tools=_chat_tools(self.tools), tool_choice=_chat_tool_choice(self.tool_choice),
            parallel_tool_calls=self.parallel_tool_calls)


def _messages(value: str | list[dict[str, Any]]) -> list[ChatMessage]:
    if isinstance(value, str):
        return [ChatMessage(role="user", content=value)]
    return [_message(i, item) for i, item in enumerate(value)]


def _message(i: int, item: dict[str, Any]) -> ChatMessage:
    """One input item as a chat message: a message, or a function call and its output (a
    conversation that called tools, sent back whole as the API's stateless form)."""
    kind = item.get("type", "message")
    if kind == "function_call":
        call = {"id": _field(i, item, "call_id"), "type": "function",
                "function": {"name": _field(i, item, "name"),
                             "arguments": _field(i, item, "arguments")}}
        return ChatMessage(role="assistant", content=None, tool_calls=[call])
    if kind == "function_call_output":
        output = item.get("output")
        if not isinstance(output, str):
            raise ServerError(400, f"input[{i}].output must be a string", f"input[{i}].output")
        return ChatMessage(role="tool", content=output, tool_call_id=_field(i, item, "call_id"))
    if kind != "message":
        raise ServerError(400, f"input[{i}].type {kind!r} is not supported: only message, "
                          f"function_call and function_call_output items", f"input[{i}].type")
    role = item.get("role")
    if role not in _ROLES:
        raise ServerError(400, f"input[{i}].role must be one of {', '.join(_ROLES)}, got "
                          f"{role!r}", f"input[{i}].role")
    return ChatMessage(role=role, content=_content(i, item.get("content")))


def _field(i: int, item: dict[str, Any], name: str) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise ServerError(400, f"input[{i}].{name} must be a string, got {value!r}",
                          f"input[{i}].{name}")
    return value


def _content(i: int, content: Any) -> str:
    """A message's text: a string, or its text parts joined (images and files refused)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ServerError(400, f"input[{i}].content must be a string or a list of input_text "
                          f"parts", f"input[{i}].content")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise ServerError(400, f"input[{i}].content[{j}] must be {{\"type\": "
                              f"\"input_text\", \"text\": ...}} (text only; got type "
                              f"{kind!r})", f"input[{i}].content[{j}].type")
        texts.append(part["text"])
    return "".join(texts)


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """text.format as chat's response_format (text, json_object or json_schema)."""
    text = text or {}
    if text.get("verbosity") is not None:
        raise ServerError(400, "text.verbosity is not supported by this server",
                          "text.verbosity")
    fmt = text.get("format")
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") != "json_schema":
        raise ServerError(400, f"text.format.type must be text, json_object or json_schema, "
                          f"got {fmt.get('type')!r}", "text.format.type")
    if not isinstance(fmt.get("schema"), dict):
        raise ServerError(400, "text.format.schema must be a JSON schema object (text: "
                          "{format: {type: json_schema, name, schema}})", "text.format.schema")
    return {"type": "json_schema", "json_schema": {"name": fmt.get("name", "response"),
                                                   "schema": fmt["schema"]}}


def _chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses' flat function tools in chat's nested form; built-in tools refused."""
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise ServerError(400, f"tools[{i}].type {tool.get('type')!r} is not supported: "
                              f"only function tools (no built-in tools)", f"tools[{i}].type")
        if not isinstance(tool.get("name"), str):
            raise ServerError(400, f"tools[{i}] must be {{\"type\": \"function\", \"name\": "
                              f"..., \"parameters\": {{...}}}}", f"tools[{i}].name")
        function = {k: tool[k] for k in ("name", "description", "parameters", "strict")
                    if tool.get(k) is not None}
        out.append({"type": "function", "function": function})
    return out


def _chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if choice is None or isinstance(choice, str):
        return choice  # none, auto, required: tool_calls.py checks them
    if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
        raise ServerError(400, f"tool_choice must be none, auto, required or {{\"type\": "
                          f"\"function\", \"name\": ...}}, got {choice!r}", "tool_choice")
    return {"type": "function", "function": {"name": choice["name"]}}
