"""The /v1/completions and /v1/chat/completions handlers: requests in, OpenAI JSON or SSE out.

Both run the same way; what differs is the shape of their JSON, an object chosen when the
request is built (response_formats.py). Streams send what the engine's cumulative outputs add,
holding back what could still change (stream_holdback.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, StreamingResponse

from shardserve.engine.async_engine import AsyncEngineClient
from shardserve.engine.structured_output import check_grammar
from shardserve.entrypoints.server.disconnect import unless_disconnected
from shardserve.entrypoints.server.limits import ServerLimits
from shardserve.entrypoints.server.lora_serving import ServedAdapters
from shardserve.entrypoints.server.prompts import Prompt, PromptPreparer
from shardserve.entrypoints.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ServerError,
    TokenizeRequest,
    error_body,
)
from shardserve.entrypoints.server.response_formats import (
    ChatFormat,
    CompletionFormat,
    ResponseFormat,
    ToolCallFormat,
    final_outputs,
)
from shardserve.entrypoints.server.tool_calls import ToolMode, tool_mode
from shardserve.errors import EngineDeadError
from shardserve.lora.request import LoRARequest
from shardserve.outputs import RequestOutput
from shardserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from shardserve.entrypoints.server.responses_api import ResponsesView

logger = logging.getLogger(__name__)


@dataclass
class _Job:
    """One request as the handlers see it: its prompts (one engine request each) and params."""

    request_id: str
    model: str
    prompts: list[Prompt]
    params: list[SamplingParams]
    stream: bool
    include_usage: bool
    format: ResponseFormat  # completion or chat JSON
    created: int = field(default_factory=lambda: int(time.time()))
    priority: int = 0  # vLLM's extension (--scheduling-policy priority)
    lora_request: LoRARequest | None = None  # `model` named an adapter

    @property
    def n(self) -> int:
        return self.params[0].n


class OpenAIServing:
    def __init__(self, client: AsyncEngineClient, served_name: str, aliases: set[str],
                 limits: ServerLimits | None = None, chat_template: str | None = None,
                 tool_parser: str | None = None, adapters: ServedAdapters | None = None
                 ) -> None:
        self.tool_parser = tool_parser  # --tool-call-parser, with --enable-auto-tool-choice
        self.client = client
        self.served_name = served_name
        self.aliases = aliases | {served_name}
        self.adapters = adapters or ServedAdapters(client, served_name)
        self.max_model_len = client.config.model_config.max_model_len
        self.limits = limits or ServerLimits()
        self.prompts = PromptPreparer(client.inputs, client.tokenizer, self.max_model_len,
                                      chat_template)

    # ---- building a job ----
    def check_model(self, name: str | None) -> None:
        self.lora_for(name)

    def lora_for(self, name: str | None) -> LoRARequest | None:
        """The adapter a request's `model` names (None: the base model); a 404 naming what is
        served for any other name (never the base model in its place)."""
        if name is None or name in self.aliases:
            return None
        lora = self.adapters.get(name)
        if lora is None:
            loaded = ", ".join(f"`{n}`" for n in self.adapters.names())
            raise ServerError(404, f"The model `{name}` does not exist; this server serves "
                              f"`{self.served_name}`" + (f" and the LoRA adapters {loaded}"
                              if loaded else ""), "model")
        return lora

    def _max_tokens(self, ids: list[int], requested: int | None, explicit: bool,
                    default: int | None) -> int:
        room = self.max_model_len - len(ids)
        if room < 1:
            raise ServerError(400, f"the prompt is {len(ids)} tokens, which leaves no room to "
                              f"generate within max_model_len={self.max_model_len}", "prompt")
        if explicit and requested is not None and requested > room:
            raise ServerError(400, f"max_tokens={requested} is too large: the prompt is "
                              f"{len(ids)} tokens and max_model_len={self.max_model_len}, so at "
                              f"most {room} tokens can be generated", "max_tokens")
        value = requested if explicit else default
        return room if value is None else min(value, room)

    def _params(self, req: Any, ids: list[int], requested: int | None, explicit: bool,
                default: int | None, logprobs: int | None) -> SamplingParams:
        max_tokens = self._max_tokens(ids, requested, explicit, default)
        try:
            params = req.sampling_params(max_tokens, logprobs)
            params.check_token_ids(self.client.inputs.vocab_size)
            return params
        except ValueError as e:
            message = str(e)
            # The field named first ("logit_bias[5] must be ..." is logit_bias's).
            raise ServerError(400, message, message.split(" ", 1)[0].split("[", 1)[0]) from e

    @staticmethod
    async def _check_grammar(params: SamplingParams) -> None:
        """A grammar that does not parse is a 400 before anything is queued (parsed on a thread:
        the first one imports xgrammar, which takes seconds)."""
        spec = params.structured_outputs
        if spec is None:
            return
        try:
            await asyncio.to_thread(check_grammar, spec)
        except ValueError as e:
            raise ServerError(400, str(e), "structured_outputs" if "structured_outputs"
                              in str(e) else "response_format") from e

    async def completion_job(self, req: CompletionRequest) -> _Job:
        _log_unknown(req.check_supported())
        lora = self.lora_for(req.model)
        self.limits.check_sampling(req)
        texts = req.prompts()
        self.limits.check_prompt_count(len(texts), req.n)
        self.client.check_alive()
        truncate = _truncation(req)
        prompts = await self.prompts.completion_prompts(texts, truncate)
        explicit = "max_tokens" in req.model_fields_set
        params = [self._params(req, ids, req.max_tokens, explicit, 16, req.logprobs)
                  for _, ids in prompts]
        await self._check_grammar(params[0])
        return _Job(f"cmpl-{uuid.uuid4().hex}", req.model or self.served_name, prompts, params,
                    req.stream, req.include_usage, await self._completion_format(req, prompts),
                    priority=self._priority(req), lora_request=lora)

    async def _completion_format(self, req: CompletionRequest,
                                 prompts: list[Prompt]) -> CompletionFormat:
        if not req.echo:
            return CompletionFormat(None)
        # A truncated prompt echoes the tokens that were kept, not the text sent.
        echo = [text if text is not None and req.truncate_prompt_tokens is None
                else await self.prompts.decode(ids) for text, ids in prompts]
        if not req.echo_logprobs:
            return CompletionFormat(echo)
        # The first prompt token has no logprob, so nothing decoded it: its text is decoded here.
        firsts = [await self.prompts.decode(ids[:1]) for _, ids in prompts]
        return CompletionFormat(echo, firsts, req.prompt_logprobs is not None)

    async def chat_job(self, req: ChatCompletionRequest) -> _Job:
        _log_unknown(req.check_supported())
        if req.continue_final_message and req.add_generation_prompt:
            raise ServerError(400, "continue_final_message needs add_generation_prompt false: "
                              "the last message is continued, not answered",
                              "continue_final_message")
        lora = self.lora_for(req.model)
        self.limits.check_sampling(req)
        self.limits.check_chat_template(req)
        self.limits.check_prompt_count(1, req.n)
        self.client.check_alive()
        messages = [m.as_template_dict() for m in req.messages]
        tools = tool_mode(req.tools, req.tool_choice, self.tool_parser, req.parallel_tool_calls)
        prompt = await self.prompts.chat_prompt(messages, req.add_generation_prompt,
                                                _template_kwargs(req, tools), _truncation(req))
        requested = req.requested_max_tokens
        params = _constrained(self._params(req, prompt[1], requested, requested is not None,
                                           None, req.num_logprobs), tools)
        await self._check_grammar(params)
        return _Job(f"chatcmpl-{uuid.uuid4().hex}", req.model or self.served_name, [prompt],
                    [params], req.stream, req.include_usage, _chat_format(params, tools),
                    priority=self._priority(req), lora_request=lora)

    def _priority(self, req: CompletionRequest | ChatCompletionRequest) -> int:
        """The request's priority; a 400 naming it where the engine cannot honour it."""
        try:
            return self.client.inputs.check_priority(req.priority)
        except ValueError as e:
            raise ServerError(400, str(e), "priority") from e

    # ---- tokenizer endpoints ----
    async def tokenize(self, req: TokenizeRequest) -> dict[str, Any]:
        req.check()
        self.check_model(req.model)
        tok = self.client.tokenizer
        if req.messages is not None:
            messages = [m.as_template_dict() for m in req.messages]
            ids = await self.prompts.render_chat(messages, req.add_generation_prompt)
        else:
            text = req.prompt or ""
            ids = await self.prompts.encode(text, req.add_special_tokens)
        strs = tok.convert_ids_to_tokens(ids) if req.return_token_strs else None
        return {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids,
                "token_strs": strs}

    async def detokenize(self, req: DetokenizeRequest) -> dict[str, Any]:
        self.check_model(req.model)
        vocab = self.client.inputs.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise ServerError(400, f"tokens contain {bad[:5]}, outside the vocabulary "
                              f"[0, {vocab})", "tokens")
        return {"prompt": await self.prompts.decode(req.tokens)}

    # ---- running a job ----
    async def respond(self, job_to_build: Awaitable[_Job], raw: HTTPRequest,
                      view: ResponsesView | None = None):
        """Build the job (completion_job's or chat_job's: tokenizing runs off the event loop)
        and answer it: JSON, or an SSE stream; `view` reshapes a chat job's body and stream
        into another API's (/v1/responses)."""
        job = await job_to_build
        # Before any response starts: a stream's 200 would leave only an error event to send.
        self.client.admit(len(job.prompts) * job.n)
        if job.stream:
            events = self._sse(job) if view is None else self._view_events(job, view)
            return StreamingResponse(events, media_type="text/event-stream")
        body = await unless_disconnected(self._collect(job), raw)
        if isinstance(body, JSONResponse):
            return body
        return JSONResponse(body if view is None else view.body(job, body))

    def _view_events(self, job: _Job, view: ResponsesView) -> AsyncIterator[str]:
        finals: dict[int, RequestOutput] = {}
        outputs = _recorded(_merge(self._streams(job)), finals)
        return view.events(job, job.format.stream(outputs, job.n, job.params[0].stop), finals)

    def _streams(self, job: _Job) -> list[AsyncIterator[RequestOutput]]:
        return [self.client.generate(f"{job.request_id}-{i}", prompt, params, job.priority,
                                     lora_request=job.lora_request)
                for i, (prompt, params) in enumerate(zip(job.prompts, job.params, strict=True))]

    async def _collect(self, job: _Job) -> dict[str, Any]:
        finals = await final_outputs(_merge(self._streams(job)))
        choices = [job.format.final_choice(i, i * job.n + c.index, c, finals[i])
                   for i in range(len(job.prompts)) for c in finals[i].outputs]
        return {"id": job.request_id, "object": job.format.object, "created": job.created,
                "model": job.model, "choices": choices, "usage": _usage(job, finals),
                **job.format.body_extras(finals)}

    async def _sse(self, job: _Job) -> AsyncIterator[str]:
        finals: dict[int, RequestOutput] = {}
        outputs = _recorded(_merge(self._streams(job)), finals)
        try:
            async for choices in job.format.stream(outputs, job.n, job.params[0].stop):
                yield _event(self._chunk(job, choices))
            if job.include_usage:
                yield _event(self._chunk(job, [], _usage(job, finals)))
        except EngineDeadError as e:
            yield _event(error_body(str(e), "ServiceUnavailableError", None, 503))
        yield "data: [DONE]\n\n"

    def _chunk(self, job: _Job, choices: list[dict], usage: dict | None = None) -> dict:
        chunk = {"id": job.request_id, "object": job.format.chunk_object,
                 "created": job.created, "model": job.model, "choices": choices}
        if job.include_usage:
            chunk["usage"] = usage
        return chunk


def _truncation(req: CompletionRequest | ChatCompletionRequest) -> int | None:
    """truncate_prompt_tokens, checked before any prompt is cut by it (400 naming it)."""
    try:
        return SamplingParams(truncate_prompt_tokens=req.truncate_prompt_tokens) \
            .truncate_prompt_tokens
    except ValueError as e:
        raise ServerError(400, str(e), "truncate_prompt_tokens") from e


def _template_kwargs(req: ChatCompletionRequest, tools: ToolMode | None) -> dict[str, Any]:
    """apply_chat_template's extra arguments: the request's, and what the template must know."""
    kwargs = req.template_kwargs()
    if req.continue_final_message:
        kwargs["continue_final_message"] = True
    if tools is not None:
        kwargs["tools"] = req.tools
    return kwargs


def _constrained(params: SamplingParams, tools: ToolMode | None) -> SamplingParams:
    """params with the grammar that tool_choice named or required enforces, if any."""
    constraint = tools.constraint() if tools is not None else None
    if constraint is None:
        return params
    if params.structured_outputs is not None:
        raise ServerError(400, "tool_choice named or required constrains the output already; "
                          "drop response_format / structured_outputs", "tool_choice")
    return dataclasses.replace(params, structured_outputs=constraint)


def _chat_format(params: SamplingParams, tools: ToolMode | None) -> ChatFormat:
    top_logprobs = params.logprobs or 0
    # tool_choice "none": the tools only reach the template, the text is plain content.
    if tools is None or tools.kind == "none":
        return ChatFormat(top_logprobs)
    return ToolCallFormat(top_logprobs, tools)


def _log_unknown(names: list[str]) -> None:
    if names:
        logger.info("ignored request fields that neither OpenAI nor vLLM define: %s",
                    ", ".join(names))


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def _usage(job: _Job, finals: dict[int, RequestOutput]) -> dict[str, int]:
    prompt_tokens = sum(len(ids) for _, ids in job.prompts)
    completion = sum(len(c.token_ids) for out in finals.values() for c in out.outputs)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion}


async def _recorded(outputs: AsyncIterator[tuple[int, RequestOutput]],
                    finals: dict[int, RequestOutput]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """outputs, keeping each prompt's latest in finals (the usage chunk counts them)."""
    async for i, out in outputs:
        finals[i] = out
        yield i, out


async def _merge(streams: list[AsyncIterator[RequestOutput]]
                 ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) from several streams as they come. Leaving early closes every
    stream, which aborts its engine request."""
    if len(streams) == 1:  # no tasks and queue needed
        async with contextlib.aclosing(streams[0]) as stream:
            async for out in stream:
                yield 0, out
        return
    # Closed with this one, at once: its tasks are what hold the engine requests open.
    async with contextlib.aclosing(_merge_many(streams)) as merged:
        async for item in merged:
            yield item


async def _merge_many(streams: list[AsyncIterator[RequestOutput]]
                      ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """_merge of two or more streams: a task pumps each into one queue."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async with contextlib.aclosing(stream):
                async for out in stream:
                    queue.put_nowait((i, out))
            queue.put_nowait((i, None))
        except BaseException as e:
            queue.put_nowait((i, e))
            raise

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
