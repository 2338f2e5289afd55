"""The /v1/completions and /v1/chat/completions handlers: requests in, OpenAI JSON or SSE out.

The engine yields cumulative outputs (full text so far); streaming sends the difference. Text is
held back while it ends in an incomplete UTF-8 character ("\\ufffd") or could be the start of a
stop string, so the streamed pieces always add up to the final text.
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
from typing import Any

from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, StreamingResponse

from shardserve.engine.async_engine import AsyncEngineClient
from shardserve.engine.structured_output import check_grammar
from shardserve.entrypoints.server.limits import ServerLimits
from shardserve.entrypoints.server.prompts import Prompt, PromptPreparer
from shardserve.entrypoints.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ServerError,
    TokenizeRequest,
    error_body,
)
from shardserve.entrypoints.server.tool_calls import ToolMode, tool_mode
from shardserve.errors import EngineDeadError
from shardserve.outputs import CompletionOutput, RequestOutput
from shardserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class _Job:
    """One request as the handlers see it: its prompts (one engine request each) and params."""

    kind: str  # "completion" | "chat"
    request_id: str
    model: str
    prompts: list[Prompt]
    params: list[SamplingParams]
    stream: bool
    include_usage: bool
    created: int = field(default_factory=lambda: int(time.time()))
    echo: list[str] | None = None  # completions with echo: each prompt's text
    tools: ToolMode | None = None  # chat with tools

    @property
    def n(self) -> int:
        return self.params[0].n


@dataclass
class _Sent:
    """What streaming has already sent of one choice."""

    text_len: int = 0
    num_tokens: int = 0
    text_offset: int = 0
    started: bool = False
    finished: bool = False


class OpenAIServing:
    def __init__(self, client: AsyncEngineClient, served_name: str, aliases: set[str],
                 limits: ServerLimits | None = None, chat_template: str | None = None,
                 tool_parser: str | None = None) -> None:
        self.tool_parser = tool_parser  # --tool-call-parser, with --enable-auto-tool-choice
        self.client = client
        self.served_name = served_name
        self.aliases = aliases | {served_name}
        self.max_model_len = client.config.model_config.max_model_len
        self.limits = limits or ServerLimits()
        self.prompts = PromptPreparer(client.inputs, client.tokenizer, self.max_model_len,
                                      chat_template)

    # ---- building a job ----
    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.aliases:
            raise ServerError(404, f"The model `{name}` does not exist; this server serves "
                              f"`{self.served_name}`", "model")

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
            return req.sampling_params(max_tokens, logprobs)
        except ValueError as e:
            message = str(e)
            raise ServerError(400, message, message.split(" ", 1)[0]) from e

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
        self.check_model(req.model)
        self.limits.check_sampling(req)
        texts = req.prompts()
        self.limits.check_prompt_count(len(texts), req.n)
        self.client.check_alive()
        prompts = await self.prompts.completion_prompts(texts)
        explicit = "max_tokens" in req.model_fields_set
        params = [self._params(req, ids, req.max_tokens, explicit, 16, req.logprobs)
                  for _, ids in prompts]
        await self._check_grammar(params[0])
        echo = None
        if req.echo:
            echo = [text if text is not None else await self.prompts.decode(ids)
                    for text, ids in prompts]
        return _Job("completion", f"cmpl-{uuid.uuid4().hex}", req.model or self.served_name,
                    prompts, params, req.stream, req.include_usage, echo=echo)

    async def chat_job(self, req: ChatCompletionRequest) -> _Job:
        _log_unknown(req.check_supported())
        if req.continue_final_message and req.add_generation_prompt:
            raise ServerError(400, "continue_final_message needs add_generation_prompt false: "
                              "the last message is continued, not answered",
                              "continue_final_message")
        self.check_model(req.model)
        self.limits.check_sampling(req)
        self.limits.check_chat_template(req)
        self.limits.check_prompt_count(1, req.n)
        self.client.check_alive()
        messages = [m.as_template_dict() for m in req.messages]
        kwargs = req.template_kwargs()
        if req.continue_final_message:
            kwargs["continue_final_message"] = True
        tools = tool_mode(req.tools, req.tool_choice, self.tool_parser, req.parallel_tool_calls)
        if tools is not None:
            kwargs["tools"] = req.tools
        prompt = await self.prompts.chat_prompt(messages, req.add_generation_prompt, kwargs)
        requested = req.requested_max_tokens
        params = self._params(req, prompt[1], requested, requested is not None, None,
                              req.num_logprobs)
        constraint = tools.constraint() if tools is not None else None
        if constraint is not None:
            if params.structured_outputs is not None:
                raise ServerError(400, "tool_choice named or required constrains the output "
                                  "already; drop response_format / structured_outputs",
                                  "tool_choice")
            params = dataclasses.replace(params, structured_outputs=constraint)
        await self._check_grammar(params)
        return _Job("chat", f"chatcmpl-{uuid.uuid4().hex}", req.model or self.served_name,
                    [prompt], [params], req.stream, req.include_usage, tools=tools)

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
    async def respond(self, job_to_build: Awaitable[_Job], raw: HTTPRequest):
        """Build the job (completion_job's or chat_job's: tokenizing runs off the event loop)
        and answer it: JSON, or an SSE stream."""
        job = await job_to_build
        # Before any response starts: a stream's 200 would leave only an error event to send.
        self.client.admit(len(job.prompts) * job.n)
        if job.stream:
            return StreamingResponse(self._sse(job), media_type="text/event-stream")
        work = asyncio.ensure_future(self._collect(job))
        disconnect = asyncio.ensure_future(_wait_disconnect(raw))
        try:
            await asyncio.wait([work, disconnect], return_when=asyncio.FIRST_COMPLETED)
        finally:
            disconnect.cancel()
            if not work.done():  # the client left (or we were cancelled): abort the requests
                work.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await work
        if work.cancelled():
            return JSONResponse(error_body("client disconnected", "ClientDisconnect", None, 499),
                                status_code=499)
        return JSONResponse(work.result())

    def _streams(self, job: _Job) -> list[AsyncIterator[RequestOutput]]:
        return [self.client.generate(f"{job.request_id}-{i}", prompt, params)
                for i, (prompt, params) in enumerate(zip(job.prompts, job.params, strict=True))]

    async def _collect(self, job: _Job) -> dict[str, Any]:
        finals: dict[int, RequestOutput] = {}
        async for i, out in _merge(self._streams(job)):
            finals[i] = out
        choices = []
        for i in range(len(job.prompts)):
            prefix = job.echo[i] if job.echo else ""
            for c in finals[i].outputs:
                choice = self._choice(job, i * job.n + c.index, c, prefix + c.text, 0, None)
                if _calls_tools(job):
                    self._tool_message(job, c, choice["message"], choice)
                if job.kind == "completion" and finals[i].prompt_logprobs is not None:
                    choice["prompt_logprobs"] = _prompt_logprobs(finals[i])
                choices.append(choice)
        body = {"id": job.request_id, "object": _OBJECT[job.kind], "created": job.created,
                "model": job.model, "choices": choices, "usage": _usage(job, finals)}
        if job.kind == "chat" and finals[0].prompt_logprobs is not None:
            body["prompt_logprobs"] = _prompt_logprobs(finals[0])
        return body

    def _tool_message(self, job: _Job, c: CompletionOutput, message: dict[str, Any],
                      choice: dict[str, Any]) -> None:
        """Turn a finished generation into content + tool_calls (see tool_calls.py)."""
        assert job.tools is not None
        content, calls = job.tools.calls(c.text)
        message["content"] = content
        message["tool_calls"] = calls
        if calls and job.tools.kind != "named" and c.finish_reason == "stop":
            choice["finish_reason"] = "tool_calls"

    async def _sse_tools(self, job: _Job) -> AsyncIterator[str]:
        """A streamed tool-call response: whole, at the end, in OpenAI's delta format."""
        finals: dict[int, RequestOutput] = {}
        async for i, out in _merge(self._streams(job)):
            finals[i] = out
        for c in finals[0].outputs:
            message: dict[str, Any] = {}
            choice: dict[str, Any] = {"index": c.index, "logprobs": None,
                                      "finish_reason": c.finish_reason, "stop_reason": None}
            self._tool_message(job, c, message, choice)
            delta: dict[str, Any] = {"role": "assistant", "content": message["content"]}
            yield _event(self._chunk(job, [{**choice, "finish_reason": None, "delta": delta}]))
            calls = [{"index": k, **call} for k, call in enumerate(message["tool_calls"])]
            if calls:
                yield _event(self._chunk(job, [{**choice, "finish_reason": None,
                                                "delta": {"tool_calls": calls}}]))
            yield _event(self._chunk(job, [{**choice, "delta": {}}]))
        if job.include_usage:
            yield _event(self._chunk(job, [], _usage(job, finals)))

    async def _sse(self, job: _Job) -> AsyncIterator[str]:
        if _calls_tools(job):
            try:
                async for event in self._sse_tools(job):
                    yield event
            except EngineDeadError as e:
                yield _event(error_body(str(e), "ServiceUnavailableError", None, 503))
            yield "data: [DONE]\n\n"
            return
        sent: dict[int, _Sent] = {}
        finals: dict[int, RequestOutput] = {}
        hold = max((len(s) for s in job.params[0].stop), default=1) - 1
        for i, text in enumerate(job.echo or []):  # echo: the prompts come first
            yield _event(self._chunk(job, [
                {"index": i * job.n + k, "text": text, "logprobs": None, "finish_reason": None,
                 "stop_reason": None} for k in range(job.n)]))
        try:
            async for i, out in _merge(self._streams(job)):
                finals[i] = out
                for c in out.outputs:
                    index = i * job.n + c.index
                    chunk = self._delta_choice(job, index, c, sent.setdefault(index, _Sent()),
                                               hold)
                    if chunk is not None:
                        yield _event(self._chunk(job, [chunk]))
            if job.include_usage:
                yield _event(self._chunk(job, [], _usage(job, finals)))
        except EngineDeadError as e:
            yield _event(error_body(str(e), "ServiceUnavailableError", None, 503))
        yield "data: [DONE]\n\n"

    def _chunk(self, job: _Job, choices: list[dict], usage: dict | None = None) -> dict:
        chunk = {"id": job.request_id, "object": _CHUNK_OBJECT[job.kind],
                 "created": job.created, "model": job.model, "choices": choices}
        if job.include_usage:
            chunk["usage"] = usage
        return chunk

    def _delta_choice(self, job: _Job, index: int, c: CompletionOutput, sent: _Sent,
                      hold: int) -> dict | None:
        if sent.finished:
            return None
        end = len(c.text)
        if c.finish_reason is None:
            while end > sent.text_len and c.text[end - 1] == "\ufffd":
                end -= 1
            end = max(sent.text_len, end - hold)
        delta = c.text[sent.text_len:end]
        new_tokens = len(c.token_ids) - sent.num_tokens
        if not delta and c.finish_reason is None and (sent.started or job.kind != "chat"):
            return None
        choice = self._choice(job, index, c, delta, sent.num_tokens, sent)
        sent.text_len, sent.num_tokens = max(end, sent.text_len), sent.num_tokens + new_tokens
        sent.started, sent.finished = True, c.finish_reason is not None
        return choice

    def _choice(self, job: _Job, index: int, c: CompletionOutput, text: str,
                first_token: int, sent: _Sent | None) -> dict[str, Any]:
        logprobs = None
        if c.logprobs is not None:
            entries = list(zip(c.token_ids[first_token:], c.logprobs[first_token:], strict=False))
            if job.kind == "chat":
                logprobs = {"content": _chat_logprobs(entries, job.params[0].logprobs or 0)}
            else:
                start = sent.text_offset if sent is not None else 0
                logprobs, end = _completion_logprobs(entries, start)
                if sent is not None:
                    sent.text_offset = end
        choice: dict[str, Any] = {"index": index, "logprobs": logprobs,
                                  "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
        if job.kind == "completion":
            choice["text"] = text
        elif not job.stream:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["delta"] = {"content": text} if sent.started else \
                {"role": "assistant", "content": text}
        return choice


_OBJECT = {"completion": "text_completion", "chat": "chat.completion"}
_CHUNK_OBJECT = {"completion": "text_completion", "chat": "chat.completion.chunk"}


def _calls_tools(job: _Job) -> bool:
    return job.tools is not None and job.tools.kind != "none"


def _log_unknown(names: list[str]) -> None:
    if names:
        logger.info("ignored request fields that neither OpenAI nor vLLM define: %s",
                    ", ".join(names))


def _prompt_logprobs(out: RequestOutput) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's JSON form: per prompt token, None (the first) or token id → logprob, rank and
    decoded token."""
    return [None if entry is None else
            {str(tid): {"logprob": lp.logprob, "rank": lp.rank,
                        "decoded_token": lp.decoded_token} for tid, lp in entry.items()}
            for entry in out.prompt_logprobs or []]


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def _usage(job: _Job, finals: dict[int, RequestOutput]) -> dict[str, int]:
    prompt_tokens = sum(len(ids) for _, ids in job.prompts)
    completion = sum(len(c.token_ids) for out in finals.values() for c in out.outputs)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion}


def _token_text(lp: Any, token_id: int) -> str:
    return lp.decoded_token if lp.decoded_token is not None else str(token_id)


def _chat_logprobs(entries: list, top_n: int) -> list[dict[str, Any]]:
    content = []
    for token_id, position in entries:
        sampled = position[token_id]
        top = sorted(position.items(), key=lambda kv: -kv[1].logprob)[:top_n]
        content.append({
            "token": _token_text(sampled, token_id), "logprob": sampled.logprob,
            "bytes": list(_token_text(sampled, token_id).encode()),
            "top_logprobs": [{"token": _token_text(lp, tid), "logprob": lp.logprob,
                              "bytes": list(_token_text(lp, tid).encode())} for tid, lp in top],
        })
    return content


def _completion_logprobs(entries: list, offset: int) -> tuple[dict[str, Any], int]:
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                            "text_offset": []}
    for token_id, position in entries:
        token = _token_text(position[token_id], token_id)
        out["tokens"].append(token)
        out["token_logprobs"].append(position[token_id].logprob)
        out["top_logprobs"].append({_token_text(lp, tid): lp.logprob
                                    for tid, lp in position.items()})
        out["text_offset"].append(offset)
        offset += len(token)
    return out, offset


async def _merge(streams: list[AsyncIterator[RequestOutput]]
                 ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) from several streams as they come. Leaving early closes every
    stream, which aborts its engine request."""
    if len(streams) == 1:
        async with contextlib.aclosing(streams[0]) as stream:
            async for out in stream:
                yield 0, out
        return
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


async def _wait_disconnect(raw: HTTPRequest) -> None:
    """Returns when the client disconnects (the body has been read: receive() waits for that)."""
    while True:
        message = await raw.receive()
        if message["type"] == "http.disconnect":
            return
