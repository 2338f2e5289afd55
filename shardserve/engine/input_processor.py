"""The front end's input processing, one for every front end (LLM, the server, AsyncLLM):
prompt checks, tokenization, sampling-param checks and the fan-out of `n` into child requests.

What leaves a front end for an engine core is an `EngineCoreRequest` per child: a small typed
message, picklable, holding nothing engine-internal; the core builds its own `Request` from it.
Everything that can be wrong with a request is caught here, before it reaches a core, so a bad
request raises a ValueError for its caller and never disturbs the requests already running.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from shardserve.config import EngineConfig
from shardserve.engine.request import Request
from shardserve.engine.structured_output import check_grammar
from shardserve.sampling_params import SamplingParams

PromptType = str | dict[str, Any] | Sequence[int]


class Encoder(Protocol):
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...


@dataclass(frozen=True)
class EngineCoreRequest:
    """One child request, as it crosses from a front end to an engine core."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()

    def to_request(self) -> Request:
        """The engine core's own bookkeeping object for it (built on the core's side)."""
        return Request(self.request_id, list(self.prompt_token_ids), self.sampling_params,
                       eos_token_ids=self.eos_token_ids)


@dataclass(frozen=True)
class ProcessedRequest:
    """A checked request: its text (if any), token ids, and its children's params by id."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: dict[str, SamplingParams]
    eos_token_ids: tuple[int, ...]

    def core_requests(self) -> list[EngineCoreRequest]:
        return [EngineCoreRequest(child_id, self.prompt_token_ids, params, self.eos_token_ids)
                for child_id, params in self.children.items()]


class InputProcessor:
    def __init__(self, config: EngineConfig, tokenizer: Encoder) -> None:
        self.config = config
        self.tokenizer = tokenizer

    @property
    def vocab_size(self) -> int:
        return self.config.model_config.arch.vocab_size

    def process_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """Text and token ids of a prompt; raises ValueError naming what is wrong."""
        if isinstance(prompt, str):
            text, ids = prompt, self.tokenizer.encode(prompt, add_special_tokens=True)
        elif isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            text, ids = prompt.get("prompt"), list(prompt["prompt_token_ids"])
        elif isinstance(prompt, dict) and "prompt" in prompt:
            return self.process_prompt(prompt["prompt"])
        elif isinstance(prompt, Sequence) and all(isinstance(t, int) for t in prompt):
            text, ids = None, list(prompt)
        else:
            raise ValueError(
                f"prompt of type {type(prompt).__name__} is not supported; pass a str, a list of "
                f"token ids, or a dict with 'prompt' or 'prompt_token_ids'"
            )
        self.check_prompt_ids(ids)
        return text, ids

    def check_prompt_ids(self, ids: list[int]) -> None:
        if not ids:
            raise ValueError("prompt is empty (0 tokens); give at least one token")
        max_len = self.config.model_config.max_model_len
        if len(ids) > max_len:
            raise ValueError(
                f"prompt is {len(ids)} tokens, longer than max_model_len={max_len}; shorten it "
                f"or raise max_model_len"
            )
        bad = [t for t in ids if not (isinstance(t, int) and 0 <= t < self.vocab_size)]
        if bad:
            raise ValueError(
                f"prompt_token_ids contain {bad[:5]}, outside the vocabulary [0, {self.vocab_size})"
            )

    @staticmethod
    def check_params(params: SamplingParams) -> None:
        """Raises ValueError for params the engine cannot run (a grammar that does not parse)."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
        if params.structured_outputs is not None:
            check_grammar(params.structured_outputs)

    def process(self, request_id: str, prompt: PromptType | tuple[str | None, list[int]],
                params: SamplingParams) -> ProcessedRequest:
        """Check everything and fan `n` out; `prompt` may already be (text, ids) from
        process_prompt."""
        self.check_params(params)
        text, ids = prompt if isinstance(prompt, tuple) else self.process_prompt(prompt)
        children = {
            (request_id if params.n == 1 else f"{request_id}#{i}"): child_params(params, i)
            for i in range(params.n)
        }
        eos = self.config.model_config.arch.eos_token_ids
        return ProcessedRequest(request_id, text, ids, children, eos)


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """The params of sequence `index` of a request: n=1, and a distinct seed when seeded."""
    if params.n == 1:
        return params
    seed = None if params.seed is None else params.seed + index
    return dataclasses.replace(params, n=1, seed=seed)
