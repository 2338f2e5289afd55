"""/v1/responses: a Responses API request served as a chat job, answered in the Responses shape.

The request becomes a chat completion request (responses_protocol.py) and runs on the chat path
(serving.OpenAIServing.chat_job and respond), so templates, structured outputs, tool calls,
limits, admission and disconnects behave as on chat. This module only reshapes what the chat
path produces: its JSON body into a Response object, and its stream's choices (already held
back for stop strings and partial characters, stream_holdback.py) into the API's typed events:

    response.created, response.in_progress,
    per message:  output_item.added, content_part.added, output_text.delta (one per chunk),
                  output_text.done, content_part.done, output_item.done
    per tool call: output_item.added, function_call_arguments.delta / .done, output_item.done
    response.completed (response.incomplete when max_output_tokens cut the output)

every event with its type and a sequence_number counting from 0.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import Request as HTTPRequest

from shardserve.entrypoints.server.protocol import ServerError
from shardserve.entrypoints.server.responses_protocol import ResponsesRequest
from shardserve.errors import EngineDeadError
from shardserve.outputs import RequestOutput

if TYPE_CHECKING:
    from shardserve.entrypoints.server.serving import OpenAIServing, _Job

logger = logging.getLogger(__name__)

# The chat path names chat's fields in its 400s; a Responses client sent these instead.
_PARAMS = {"max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens",
           "messages": "input", "prompt": "input", "response_format": "text.format",
           "structured_outputs": "text.format"}


async def respond(serving: OpenAIServing, req: ResponsesRequest, raw: HTTPRequest) -> Any:
    """Answer one /v1/responses request: a Response object, or its event stream."""
    unknown = req.check_supported()
    if unknown:
        logger.info("ignored request fields that OpenAI's Responses API does not define: %s",
                    ", ".join(unknown))
    return await serving.respond(_chat_job(serving, req), raw, ResponsesView(req))


async def _chat_job(serving: OpenAIServing, req: ResponsesRequest) -> _Job:
    try:
        return await serving.chat_job(req.as_chat())
    except ServerError as e:
        param = _PARAMS.get(e.param or "", e.param)
        message = e.message
        if e.param in _PARAMS and message.startswith(e.param):
            message = param + message[len(e.param):]
        raise ServerError(e.status, message, param, e.err_type) from e


class ResponsesView:
    """How one request's chat job looks as a Response: its JSON body and its events."""

    def __init__(self, req: ResponsesRequest) -> None:
        self.req = req
        self.id = f"resp_{uuid.uuid4().hex}"
        self.created_at = int(time.time())

    def response(self, job: _Job, status: str, output: list[dict[str, Any]],
                 usage: dict[str, Any] | None) -> dict[str, Any]:
        """The Response object, with the request's parameters echoed as OpenAI does."""
        req = self.req
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {
            "id": self.id, "object": "response", "created_at": self.created_at,
            "status": status, "error": None, "incomplete_details": incomplete,
            "model": job.model, "output": output, "usage": usage,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "metadata": req.metadata or {}, "parallel_tool_calls": req.parallel_tool_calls
            is not False, "temperature": req.temperature, "top_p": req.top_p,
            "tool_choice": req.tool_choice or "auto", "tools": req.tools or [],
            "text": req.text or {"format": {"type": "text"}}, "user": req.user,
            "store": False, "background": False, "previous_response_id": None,
            "reasoning": None, "truncation": "disabled",
        }

    def body(self, job: _Job, chat: dict[str, Any]) -> dict[str, Any]:
        """The Response object of a finished chat body."""
        choice = chat["choices"][0]
        message, status = choice["message"], _status(choice["finish_reason"])
        output = []
        content, calls = message.get("content"), message.get("tool_calls") or []
        if content is not None and (content or not calls):
            output.append(message_item(f"msg_{uuid.uuid4().hex}", content, status))
        output += [call_item(f"fc_{uuid.uuid4().hex}", call, "completed") for call in calls]
        usage = chat["usage"]
        return self.response(job, status, output,
                             usage_of(usage["prompt_tokens"], usage["completion_tokens"]))

    async def events(self, job: _Job, choices: AsyncIterator[list[dict[str, Any]]],
                     finals: dict[int, RequestOutput]) -> AsyncIterator[str]:
        """The SSE events of a streamed request from the chat stream's choices; `finals`
        holds the engine's latest output once the choices have ended (for the usage)."""
        items = _StreamItems()
        yield items.event("response.created", response=self.response(job, "in_progress", [],
                                                                      None))
        yield items.event("response.in_progress",
                          response=self.response(job, "in_progress", [], None))
        try:
            async with contextlib.aclosing(choices) as chunks:
                async for chunk in chunks:
                    for event in items.feed(chunk[0]):
                        yield event
        except EngineDeadError as e:
            yield items.event("error", code="ServiceUnavailableError", message=str(e),
                              param=None)
            return
        for event in items.close_message():
            yield event
        status = _status(items.finish_reason)
        outputs = finals[0].outputs if finals else []
        usage = usage_of(len(job.prompts[0][1]), sum(len(c.token_ids) for c in outputs))
        final = self.response(job, status, items.output, usage)
        yield items.event(f"response.{status}", response=final)


class _StreamItems:
    """The output items of one stream, built event by event from chat's delta choices."""

    def __init__(self) -> None:
        self.seq = 0
        self.output: list[dict[str, Any]] = []  # the finished items
        self.message_id: str | None = None  # the open message item
        self.text = ""
        self.finish_reason: str | None = None

    def event(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"

    def feed(self, choice: dict[str, Any]) -> list[str]:
        """The events of one chat chunk's choice."""
        delta, out = choice.get("delta") or {}, []
        text = delta.get("content")
        if text is not None:
            if self.message_id is None:
                out += self._open_message()
            if text:
                self.text += text
                out.append(self._text_event("response.output_text.delta", delta=text))
        for call in delta.get("tool_calls") or []:
            out += self.close_message()
            out += self._call_events(call)
        self.finish_reason = choice.get("finish_reason") or self.finish_reason
        return out

    def _open_message(self) -> list[str]:
        self.message_id = f"msg_{uuid.uuid4().hex}"
        item = {"type": "message", "id": self.message_id, "status": "in_progress",
                "role": "assistant", "content": []}
        return [self.event("response.output_item.added", output_index=len(self.output),
                           item=item),
                self._text_event("response.content_part.added", part=_text_part(""))]

    def _text_event(self, kind: str, **fields: Any) -> str:
        if kind.startswith("response.output_text."):
            fields["logprobs"] = []
        return self.event(kind, item_id=self.message_id, output_index=len(self.output),
                          content_index=0, **fields)

    def close_message(self) -> list[str]:
        """The events that finish the open message item, if any."""
        if self.message_id is None:
            return []
        item = message_item(self.message_id, self.text, _status(self.finish_reason))
        out = [self._text_event("response.output_text.done", text=self.text),
               self._text_event("response.content_part.done", part=_text_part(self.text)),
               self.event("response.output_item.done", output_index=len(self.output),
                          item=item)]
        self.output.append(item)
        self.message_id, self.text = None, ""
        return out

    def _call_events(self, call: dict[str, Any]) -> list[str]:
        """A tool call arrives whole (tool_calls.py): its item with all its arguments."""
        item_id, index = f"fc_{uuid.uuid4().hex}", len(self.output)
        item = call_item(item_id, call, "completed")
        arguments = item["arguments"]
        out = [self.event("response.output_item.added", output_index=index,
                          item={**item, "arguments": "", "status": "in_progress"}),
               self.event("response.function_call_arguments.delta", item_id=item_id,
                          output_index=index, delta=arguments),
               self.event("response.function_call_arguments.done", item_id=item_id,
                          output_index=index, arguments=arguments),
               self.event("response.output_item.done", output_index=index, item=item)]
        self.output.append(item)
        return out


def _status(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [_text_part(text)]}


def call_item(item_id: str, call: dict[str, Any], status: str) -> dict[str, Any]:
    """A chat tool call ({id, type, function: {name, arguments}}) as a function_call item."""
    return {"type": "function_call", "id": item_id, "call_id": call["id"],
            "name": call["function"]["name"], "arguments": call["function"]["arguments"],
            "status": status}


def usage_of(input_tokens: int, output_tokens: int) -> dict[str, Any]:
    return {"input_tokens": input_tokens,
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": input_tokens + output_tokens}
