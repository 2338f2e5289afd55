"""The front end's input processing, one for every front end (LLM, the server, AsyncLLM):
prompt checks, tokenization, sampling-param checks and the fan-out of `n` into child requests.

What leaves a front end for an engine core is an `EngineCoreRequest` per child: a small typed
message, picklable, holding nothing engine-internal; the core builds its own `Request` from it.
Everything that can be wrong with a request is caught here, before it reaches a core, so a bad
request raises a ValueError for its caller and never disturbs the requests already running.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from shardserve.config import EngineConfig
from shardserve.engine.lora_requests import check_lora_request
from shardserve.engine.pooling import check_runner
from shardserve.engine.request import Request
from shardserve.engine.structured_output import check_grammar
from shardserve.lora.request import LoRARequest
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
    priority: int = 0
    lora_request: LoRARequest | None = None
    # A request moved from a replica that died (engine/replica_recovery.py): the tokens it had
    # produced there. The core takes it as a request preempted after them: it recomputes prompt
    # + these, its sampling positions (seeds), budget, penalties and grammar go on from there.
    output_token_ids: tuple[int, ...] = ()

    def to_request(self) -> Request:
        """The engine core's own bookkeeping object for it (built on the core's side)."""
        return Request(self.request_id, list(self.prompt_token_ids), self.sampling_params,
                       eos_token_ids=self.eos_token_ids, priority=self.priority,
                       output_token_ids=list(self.output_token_ids),
                       lora_request=self.lora_request)


@dataclass(frozen=True)
class ProcessedRequest:
    """A checked request: its text (if any), token ids, and its children's params by id."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: dict[str, SamplingParams]
    eos_token_ids: tuple[int, ...]
    priority: int = 0
    lora_request: LoRARequest | None = None

    def core_requests(self) -> list[EngineCoreRequest]:
        return [EngineCoreRequest(child_id, self.prompt_token_ids, params, self.eos_token_ids,
                                  self.priority, self.lora_request)
                for child_id, params in self.children.items()]


class InputProcessor:
    def __init__(self, config: EngineConfig, tokenizer: Encoder) -> None:
        self.config = config
        self.tokenizer = tokenizer

    @property
    def vocab_size(self) -> int:
        return self.config.model_config.arch.vocab_size

    def process_prompt(self, prompt: PromptType, truncate_prompt_tokens: int | None = None
                       ) -> tuple[str | None, list[int]]:
        """Text and token ids of a prompt (its last `truncate_prompt_tokens` ids only, when
        given: the text stays the one passed in); raises ValueError naming what is wrong."""
        if isinstance(prompt, str):
            text, ids = prompt, self.tokenizer.encode(prompt, add_special_tokens=True)
        elif isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            text, ids = prompt.get("prompt"), list(prompt["prompt_token_ids"])
        elif isinstance(prompt, dict) and "prompt" in prompt:
            return self.process_prompt(prompt["prompt"], truncate_prompt_tokens)
        elif isinstance(prompt, Sequence) and all(isinstance(t, int) for t in prompt):
            text, ids = None, list(prompt)
        else:
            raise ValueError(
                f"prompt of type {type(prompt).__name__} is not supported; pass a str, a list of "
                f"token ids, or a dict with 'prompt' or 'prompt_token_ids'"
            )
        ids = self.truncated(ids, truncate_prompt_tokens)
        self.check_prompt_ids(ids)
        return text, ids

    def truncated(self, ids: list[int], truncate_prompt_tokens: int | None) -> list[int]:
        """The last k ids (k = truncate_prompt_tokens; -1 means max_model_len, as vLLM)."""
        k = truncate_prompt_tokens
        if k is None:
            return ids
        if k == -1:
            k = self.config.model_config.max_model_len
        return ids[-k:] if len(ids) > k else ids

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

    def check_params(self, params: SamplingParams) -> None:
        """Raises ValueError for params the engine cannot run (a grammar that does not parse,
        a token id outside the vocabulary)."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
        check_runner(self.config, params)  # generation on a pooling engine, or the reverse
        params.check_token_ids(self.vocab_size)
        if params.structured_outputs is not None:
            check_grammar(params.structured_outputs)

    def check_priority(self, priority: Any) -> int:
        """The request's priority as an int; ValueError for a non-integer, or for a priority
        other than 0 when the engine does not schedule by priority (as vLLM refuses it)."""
        if isinstance(priority, bool) or not isinstance(priority, numbers.Integral):
            raise ValueError(f"priority must be an int, got {priority!r}")
        policy = self.config.scheduler_config.scheduling_policy
        if priority != 0 and policy != "priority":
            raise ValueError(
                f"priority={priority} needs priority scheduling, but this engine runs "
                f"scheduling_policy={policy!r}; start it with scheduling_policy='priority' "
                f"(--scheduling-policy priority) or leave priority at 0")
        return int(priority)

    def with_bad_words(self, params: SamplingParams) -> SamplingParams:
        """params with bad_words as token-id sequences for the workers (a copy: the caller's
        object may be reused with another request)."""
        if not params.bad_words:
            return params
        sequences = bad_words_token_ids(self.tokenizer, params.bad_words,
                                        params.bad_words_token_ids or [])
        return dataclasses.replace(params, bad_words_token_ids=sequences)

    def process(self, request_id: str, prompt: PromptType | tuple[str | None, list[int]],
                params: SamplingParams, priority: int = 0,
                lora_request: LoRARequest | None = None) -> ProcessedRequest:
        """Check everything and fan `n` out; `prompt` may already be (text, ids) from
        process_prompt. `lora_request`: the adapter it runs with (loaded by then: see
        lora_requests.py), None for the base model."""
        self.check_params(params)
        priority = self.check_priority(priority)
        lora_request = check_lora_request(self.config, lora_request)
        truncate = params.truncate_prompt_tokens
        if isinstance(prompt, tuple):
            text, ids = prompt[0], self.truncated(prompt[1], truncate)
        else:
            text, ids = self.process_prompt(prompt, truncate)
        params = self.with_bad_words(params)
        children = {
            (request_id if params.n == 1 else f"{request_id}#{i}"): child_params(params, i)
            for i in range(params.n)
        }
        eos = self.config.model_config.arch.eos_token_ids
        return ProcessedRequest(request_id, text, ids, children, eos, priority, lora_request)


def bad_words_token_ids(tokenizer: Encoder, words: list[str],
                        known: list[list[int]]) -> list[list[int]]:
    """Each word's tokenizations, without and with a leading space (a word is spelled apart
    from what precedes it or glued to it), added to `known`; no sequence twice."""
    sequences = [list(seq) for seq in known]
    for word in words:
        bare = word.lstrip()
        for text in (bare, " " + bare):
            ids = tokenizer.encode(text, add_special_tokens=False)
            if ids and ids not in sequences:
                sequences.append(ids)
    return sequences


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """The params of sequence `index` of a request: n=1, and a distinct seed when seeded."""
    if params.n == 1:
        return params
    seed = None if params.seed is None else params.seed + index
    return dataclasses.replace(params, n=1, seed=seed)
