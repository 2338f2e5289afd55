"""The JSON shapes of /v1/completions and /v1/chat/completions, one object per request.

serving.py runs every request the same way and asks its format how a choice, a stream chunk's
choice and the response body look; a chat request that may call tools streams differently (the
calls are only parsed once the text is whole), so its format also owns the stream.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from typing import Any, ClassVar

from shardserve.entrypoints.server.stream_holdback import ChoiceStream, StreamPiece, hold_length
from shardserve.entrypoints.server.tool_calls import ToolMode
from shardserve.outputs import CompletionOutput, RequestOutput

# (prompt index, cumulative output) as the engine streams come, see serving._merge.
Outputs = AsyncIterator[tuple[int, RequestOutput]]
Choice = dict[str, Any]


class ResponseFormat(ABC):
    """How one kind of response looks; `n` choices per prompt, choice index = prompt * n + c."""

    object: ClassVar[str]  # the non-streaming response's "object"
    chunk_object: ClassVar[str]  # a stream chunk's "object"
    # Chat's first chunk carries the role, so it is sent even while there is no text yet.
    send_empty_first: ClassVar[bool] = False

    @abstractmethod
    def final_choice(self, prompt: int, index: int, c: CompletionOutput,
                     out: RequestOutput) -> Choice:
        """A choice of the non-streaming response (c is one of out's outputs, from prompt)."""

    @abstractmethod
    def delta_choice(self, index: int, c: CompletionOutput, piece: StreamPiece,
                     sent: ChoiceStream) -> Choice:
        """A stream chunk's choice: piece of c, after what `sent` says went before."""

    @abstractmethod
    def logprobs(self, entries: list, sent: ChoiceStream | None) -> dict[str, Any]:
        """The logprobs of entries ((token id, {id: Logprob}) per token); `sent` is the choice's
        stream state, None without a stream."""

    def body_extras(self, finals: dict[int, RequestOutput]) -> dict[str, Any]:
        """The fields the non-streaming body has after its usage."""
        return {}

    def opening(self, n: int) -> list[list[Choice]]:
        """The choices of the chunks a stream sends before any output."""
        return []

    async def stream(self, outputs: Outputs, n: int, stops: list[str]
                     ) -> AsyncIterator[list[Choice]]:
        """The choices of every stream chunk: each new piece of a choice as it comes."""
        for choices in self.opening(n):
            yield choices
        sent: dict[int, ChoiceStream] = {}
        hold = hold_length(stops)
        async for i, out in outputs:
            for c in out.outputs:
                index = i * n + c.index
                state = sent.setdefault(index, ChoiceStream(hold, self.send_empty_first))
                piece = state.advance(c)
                if piece is not None:
                    yield [self.delta_choice(index, c, piece, state)]

    def _head(self, index: int, c: CompletionOutput, first_token: int,
              sent: ChoiceStream | None) -> Choice:
        """The fields every choice starts with, its logprobs from first_token on."""
        logprobs = None
        if c.logprobs is not None:
            entries = list(zip(c.token_ids[first_token:], c.logprobs[first_token:],
                               strict=False))
            logprobs = self.logprobs(entries, sent)
        return {"index": index, "logprobs": logprobs, "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason}


class CompletionFormat(ResponseFormat):
    object = "text_completion"
    chunk_object = "text_completion"

    def __init__(self, echo: list[str] | None, echo_first_tokens: list[str] | None = None,
                 show_prompt_logprobs: bool = True) -> None:
        self.echo = echo  # with echo: each prompt's text, sent before its generated text
        # echo with logprobs: each prompt's first token's text (the prompt's logprobs, from
        # prompt_logprobs, lead the choice's logprobs; nothing predicts that first token).
        self.echo_first_tokens = echo_first_tokens
        # False when prompt_logprobs were only asked for the echo, not by the client.
        self.show_prompt_logprobs = show_prompt_logprobs

    def final_choice(self, prompt: int, index: int, c: CompletionOutput,
                     out: RequestOutput) -> Choice:
        choice = self._head(index, c, 0, None)
        choice["text"] = (self.echo[prompt] if self.echo else "") + c.text
        if self.echo_first_tokens is not None and c.logprobs is not None:
            choice["logprobs"] = echoed_logprobs(out, c, self.echo_first_tokens[prompt])
        if out.prompt_logprobs is not None and self.show_prompt_logprobs:
            choice["prompt_logprobs"] = prompt_logprobs(out)
        return choice

    def delta_choice(self, index: int, c: CompletionOutput, piece: StreamPiece,
                     sent: ChoiceStream) -> Choice:
        choice = self._head(index, c, piece.first_token, sent)
        choice["text"] = piece.text
        return choice

    def logprobs(self, entries: list, sent: ChoiceStream | None) -> dict[str, Any]:
        # text_offset counts on from what the stream's earlier chunks covered.
        logprobs, end = completion_logprobs(entries, sent.text_offset if sent else 0)
        if sent is not None:
            sent.text_offset = end
        return logprobs

    def opening(self, n: int) -> list[list[Choice]]:
        return [[{"index": i * n + k, "text": text, "logprobs": None, "finish_reason": None,
                  "stop_reason": None} for k in range(n)] for i, text in enumerate(self.echo or [])]


class ChatFormat(ResponseFormat):
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"
    send_empty_first = True

    def __init__(self, top_logprobs: int) -> None:
        self.top_logprobs = top_logprobs

    def final_choice(self, prompt: int, index: int, c: CompletionOutput,
                     out: RequestOutput) -> Choice:
        choice = self._head(index, c, 0, None)
        choice["message"] = {"role": "assistant", "content": c.text}
        return choice

    def delta_choice(self, index: int, c: CompletionOutput, piece: StreamPiece,
                     sent: ChoiceStream) -> Choice:
        choice = self._head(index, c, piece.first_token, sent)
        choice["delta"] = {"role": "assistant", "content": piece.text} if piece.first else \
            {"content": piece.text}
        return choice

    def logprobs(self, entries: list, sent: ChoiceStream | None) -> dict[str, Any]:
        return {"content": chat_logprobs(entries, self.top_logprobs)}

    def body_extras(self, finals: dict[int, RequestOutput]) -> dict[str, Any]:
        # One prompt per chat request: its logprobs belong to the body, not to a choice.
        if finals[0].prompt_logprobs is None:
            return {}
        return {"prompt_logprobs": prompt_logprobs(finals[0])}


class ToolCallFormat(ChatFormat):
    """Chat that may call tools: the text is parsed into content + tool_calls once whole."""

    def __init__(self, top_logprobs: int, tools: ToolMode) -> None:
        super().__init__(top_logprobs)
        self.tools = tools

    def final_choice(self, prompt: int, index: int, c: CompletionOutput,
                     out: RequestOutput) -> Choice:
        choice = super().final_choice(prompt, index, c, out)
        self._tool_message(c, choice["message"], choice)
        return choice

    async def stream(self, outputs: Outputs, n: int, stops: list[str]
                     ) -> AsyncIterator[list[Choice]]:
        """The whole response at the end, in OpenAI's delta format: the content, the calls,
        then the finish reason (these chunks carry no logprobs and no stop_reason)."""
        finals = await final_outputs(outputs)
        for c in finals[0].outputs:
            message: dict[str, Any] = {}
            choice: Choice = {"index": c.index, "logprobs": None,
                              "finish_reason": c.finish_reason, "stop_reason": None}
            self._tool_message(c, message, choice)
            delta: dict[str, Any] = {"role": "assistant", "content": message["content"]}
            yield [{**choice, "finish_reason": None, "delta": delta}]
            calls = [{"index": k, **call} for k, call in enumerate(message["tool_calls"])]
            if calls:
                yield [{**choice, "finish_reason": None, "delta": {"tool_calls": calls}}]
            yield [{**choice, "delta": {}}]

    def _tool_message(self, c: CompletionOutput, message: dict[str, Any],
                      choice: Choice) -> None:
        """Turn a finished generation into content + tool_calls (see tool_calls.py)."""
        content, calls = self.tools.calls(c.text)
        message["content"] = content
        message["tool_calls"] = calls
        # A named function is what the request asked for, not the model's choice to call.
        if calls and self.tools.kind != "named" and c.finish_reason == "stop":
            choice["finish_reason"] = "tool_calls"


async def final_outputs(outputs: Outputs) -> dict[int, RequestOutput]:
    """Each prompt's last output (the finished one), once every stream has ended."""
    finals: dict[int, RequestOutput] = {}
    async for i, out in outputs:
        finals[i] = out
    return finals


def prompt_logprobs(out: RequestOutput) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's JSON form: per prompt token, None (the first) or token id → logprob, rank and
    decoded token."""
    return [None if entry is None else
            {str(tid): {"logprob": lp.logprob, "rank": lp.rank,
                        "decoded_token": lp.decoded_token} for tid, lp in entry.items()}
            for entry in out.prompt_logprobs or []]


def _token_text(lp: Any, token_id: int) -> str:
    return lp.decoded_token if lp.decoded_token is not None else str(token_id)


def chat_logprobs(entries: list, top_n: int) -> list[dict[str, Any]]:
    """OpenAI's chat form: per token its text, logprob and UTF-8 bytes, and the top_n best."""
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


def echoed_logprobs(out: RequestOutput, c: CompletionOutput, first_token: str
                    ) -> dict[str, Any]:
    """OpenAI's legacy form over the prompt then the generated tokens; the first prompt token's
    logprob and top_logprobs are None, as OpenAI's (nothing predicts it)."""
    prompt_ids, entries = out.prompt_token_ids, out.prompt_logprobs or []
    head, offset = completion_logprobs(list(zip(prompt_ids[1:], entries[1:], strict=True)),
                                       len(first_token))
    tail, _ = completion_logprobs(list(zip(c.token_ids, c.logprobs or [], strict=False)),
                                  offset)
    first = {"tokens": first_token, "token_logprobs": None, "top_logprobs": None,
             "text_offset": 0}
    return {key: [first[key], *head[key], *tail[key]] for key in first}


def completion_logprobs(entries: list, offset: int) -> tuple[dict[str, Any], int]:
    """OpenAI's legacy form (parallel lists), and the text offset after the last token."""
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
