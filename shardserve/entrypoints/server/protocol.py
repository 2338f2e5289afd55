"""OpenAI request models (pydantic) and their mapping to SamplingParams.

Types are strict (a string is not an int), so a wrong type is a 400 naming the field; ranges are
left to SamplingParams, whose ValueErrors name the field and the valid range. Besides OpenAI's
fields, vLLM's extensions (top_k, min_p, ignore_eos, structured_outputs, ...) are accepted.

Nothing is silently ignored: a field OpenAI or vLLM defines that this server does not implement
is a 400 naming it (unless it holds its neutral value, e.g. use_beam_search=false); a field
nobody defines is ignored with one log line listing it, as vLLM does.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from shardserve.sampling_params import SamplingParams, StructuredOutputsParams


class ServerError(Exception):
    """An error answered in OpenAI's format: {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 err_type: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.err_type = err_type or _ERROR_TYPES.get(status, "BadRequestError")

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.err_type, self.param, self.status)


_ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
                413: "RequestTooLargeError", 500: "InternalServerError",
                503: "ServiceUnavailableError"}


def error_body(message: str, err_type: str, param: str | None, code: int) -> dict[str, Any]:
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


# Fields OpenAI or vLLM define that this server does not implement → their neutral values
# (a request holding that value asks for nothing, so it is served).
_UNSUPPORTED: dict[str, Any] = {
    "use_beam_search": False, "length_penalty": 1.0, "logits_processors": None,
    "return_tokens_as_token_ids": False, "return_token_ids": None, "prompt_embeds": None,
    "spaces_between_special_tokens": True, "cache_salt": None,
    "kv_transfer_params": None, "vllm_xargs": None, "mm_processor_kwargs": None,
    "documents": None, "reasoning_effort": None, "include_reasoning": None,
    "guided_json": None, "guided_regex": None, "guided_choice": None, "guided_grammar": None,
    "guided_decoding_backend": None, "guided_whitespace_pattern": None,
    "tools": None, "tool_choice": None, "parallel_tool_calls": None, "functions": None,
    "function_call": None, "audio": None, "modalities": None,
    "prediction": None, "store": None, "metadata": None, "service_tier": None,
}
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}
# Where a field refused here is served instead.
_SERVED_ELSEWHERE = {"use_beam_search": "; beam search is served on /v1/completions",
                     "length_penalty": "; it is beam search's, served on /v1/completions"}
# vLLM fields this server takes that are not declared on the models (no effect here).
_ACCEPTED = {"request_id"}


class _SamplingRequest(_Strict):
    model_config = ConfigDict(strict=True, extra="allow")
    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # OpenAI's JSON keys are strings: token ids in decimal (SamplingParams parses them).
    logit_bias: dict[str, float] | None = None
    # vLLM's extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None
    priority: int = 0  # with --scheduling-policy priority: lower first
    # Structured outputs: OpenAI's response_format, or vLLM's structured_outputs (its fields)
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    prompt_logprobs: int | None = None

    def check_supported(self) -> list[str]:
        """400 for a defined field this server does not implement; returns the names of the
        fields nobody defines (the caller logs them)."""
        extra = dict(self.model_extra or {})
        for name, neutral in _UNSUPPORTED.items():
            if name in extra and extra[name] not in (neutral, None):
                if name in _SERVED_ELSEWHERE:
                    raise ServerError(400, f"{name} is not supported on this endpoint"
                                      f"{_SERVED_ELSEWHERE[name]}", name)
                hint = (f"; use structured_outputs={{\"{_GUIDED[name]}\": ...}}"
                        if name in _GUIDED else "")
                raise ServerError(400, f"{name} is not supported by this server{hint}", name)
        if self.stream_options is not None and not self.stream:
            raise ServerError(400, "stream_options is only allowed when stream is true",
                              "stream_options")
        if self.prompt_logprobs is not None and self.stream:
            raise ServerError(400, "prompt_logprobs is not returned on streams; request it "
                              "with stream false", "prompt_logprobs")
        return sorted(set(extra) - set(_UNSUPPORTED) - _ACCEPTED)

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """Raises ValueError naming the field and the valid range (from SamplingParams)."""
        names = ("n", "temperature", "top_p", "stop", "seed", "presence_penalty",
                 "frequency_penalty", "top_k", "min_p", "repetition_penalty", "min_tokens",
                 "ignore_eos", "stop_token_ids", "skip_special_tokens",
                 "include_stop_str_in_output", "prompt_logprobs", "logit_bias",
                 "allowed_token_ids", "bad_words", "truncate_prompt_tokens")
        kwargs = {k: getattr(self, k) for k in names if getattr(self, k) is not None}
        return SamplingParams(max_tokens=max_tokens, logprobs=logprobs,
                              structured_outputs=self.structured_spec(), **kwargs)

    def structured_spec(self) -> StructuredOutputsParams | None:
        """response_format or structured_outputs as StructuredOutputsParams (ValueError naming
        the field when malformed; both at once is refused)."""
        fmt = _response_format_spec(self.response_format)
        if fmt is not None and self.structured_outputs is not None:
            raise ValueError("response_format and structured_outputs cannot both constrain "
                             "the output; give one")
        if self.structured_outputs is not None:
            try:
                return StructuredOutputsParams(**self.structured_outputs)
            except TypeError as e:  # an unknown key
                raise ValueError(f"structured_outputs: {e}") from e
        return fmt

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


def _response_format_spec(fmt: dict[str, Any] | None) -> StructuredOutputsParams | None:
    """OpenAI's response_format: text (no constraint), json_object, or json_schema."""
    if fmt is None:
        return None
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        schema = spec.get("schema", spec.get("json_schema")) if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise ValueError("response_format.json_schema.schema must be a JSON schema object "
                             "(response_format: {type: json_schema, json_schema: {name, "
                             "schema}})")
        return StructuredOutputsParams(json=schema)
    raise ValueError(f"response_format.type must be text, json_object or json_schema, got "
                     f"{kind!r}")


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None
    # vLLM's beam search extension (server/beam_serving.py): best_of beams, the best n returned
    use_beam_search: bool = False
    length_penalty: float = 1.0

    def check_supported(self) -> list[str]:
        unknown = super().check_supported()
        if self.echo_logprobs and self.stream:
            raise ServerError(400, "echo with logprobs is not returned on streams (the "
                              "prompt's logprobs come with the finished request); request it "
                              "with stream false", "echo")
        if self.suffix:
            raise ServerError(400, "suffix is not supported", "suffix")
        if self.best_of is not None and self.best_of != self.n and not self.use_beam_search:
            raise ServerError(400, f"best_of must equal n ({self.n}) when given (or set "
                              f"use_beam_search, where it is the beam width), got "
                              f"{self.best_of}", "best_of")
        if self.length_penalty != 1.0 and not self.use_beam_search:
            raise ServerError(400, f"length_penalty={self.length_penalty} applies to beam "
                              f"search only; set use_beam_search true", "length_penalty")
        if isinstance(self.prompt, list) and not self.prompt:
            raise ServerError(400, "prompt must not be an empty list", "prompt")
        if (self.model_extra or {}).get("add_special_tokens", True) is not True:
            raise ServerError(400, "add_special_tokens=false is not supported on completions "
                              "(the tokenizer's special tokens are always added)",
                              "add_special_tokens")
        return [name for name in unknown if name != "add_special_tokens"]

    @property
    def echo_logprobs(self) -> bool:
        """The prompt's tokens and logprobs lead each choice's logprobs (from prompt_logprobs,
        the first token's None as OpenAI's)."""
        return self.echo and self.logprobs is not None

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        params = super().sampling_params(max_tokens, logprobs)
        if not self.echo_logprobs:
            return params
        wanted = max(params.prompt_logprobs or 0, self.logprobs or 0)
        return dataclasses.replace(params, prompt_logprobs=wanted)

    def prompts(self) -> list[str | list[int]]:
        """The prompts of this request: a str, a list of str, token ids, or lists of them."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]  # type: ignore[list-item]
        return list(p)  # type: ignore[arg-type]


class ContentPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    model_config = ConfigDict(strict=True, extra="allow")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def as_template_dict(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        message: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.name is not None:
            message["name"] = self.name
        for key in ("tool_calls", "tool_call_id"):  # a conversation with tool calls in it
            if (self.model_extra or {}).get(key) is not None:
                message[key] = self.model_extra[key]
        return message


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    # A client's own chat template: refused unless the server trusts them (ServerLimits)
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # Tool calls (see tool_calls.py)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None

    def check_supported(self) -> list[str]:
        unknown = super().check_supported()
        if self.top_logprobs is not None and not self.logprobs:
            raise ServerError(400, "top_logprobs requires logprobs to be true", "top_logprobs")
        extra = self.model_extra or {}
        for name in ("echo", "add_special_tokens"):
            if extra.get(name):
                raise ServerError(400, f"{name} is not supported on chat completions", name)
        return sorted(set(unknown) - {"echo", "add_special_tokens", "continue_final_message"})

    @property
    def continue_final_message(self) -> bool:
        value = (self.model_extra or {}).get("continue_final_message", False)
        if not isinstance(value, bool):
            raise ServerError(400, f"continue_final_message must be a bool, got {value!r}",
                              "continue_final_message")
        return value

    def template_kwargs(self) -> dict[str, Any]:
        """apply_chat_template's extra arguments: chat_template_kwargs and chat_template."""
        kwargs = dict(self.chat_template_kwargs or {})
        if self.chat_template is not None:
            kwargs["chat_template"] = self.chat_template
        return kwargs

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(_Strict):
    """vLLM's /tokenize: a prompt, or chat messages rendered with the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise ServerError(400, "give exactly one of prompt and messages", "prompt")


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]
