"""LLMEngine: the front end of one engine — input checks, tokenization, outputs — over EngineCore.

Everything that can be wrong with a request is checked here, before it reaches the core, so a bad
request raises a ValueError for its caller and never disturbs the requests already running.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Sequence
from typing import Any

from shardserve.config import EngineConfig
from shardserve.engine.core import EngineCore
from shardserve.engine.output_processor import OutputProcessor
from shardserve.engine.request import Request
from shardserve.engine.structured_output import check_grammar
from shardserve.model.tokenizer import EngineTokenizer
from shardserve.outputs import RequestOutput
from shardserve.sampling_params import SamplingParams

PromptType = str | dict[str, Any] | Sequence[int]

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig, stream: bool = False) -> None:
        self.config = config
        # Encodes and detokenizes without transformers where it can (a cold start's first
        # token does not wait for it); `tokenizer` is the transformers one, built on first use.
        self._tokenizer = EngineTokenizer(config.model_config.tokenizer_path,
                                          config.model_config.trust_remote_code)
        self.core = EngineCore(config)
        self.processor = OutputProcessor(self._tokenizer, stream=stream)
        self._ids = itertools.count()
        self._warned_max_tokens = False

    @classmethod
    def from_engine_args(cls, engine_args: Any) -> LLMEngine:
        """vLLM's constructor: from an EngineArgs (shardserve.EngineArgs)."""
        return cls(engine_args.create_engine_config())

    @property
    def tokenizer(self) -> Any:
        """The model's transformers tokenizer (what `load_tokenizer` returns)."""
        return self._tokenizer.full

    @property
    def vocab_size(self) -> int:
        return self.config.model_config.arch.vocab_size

    def next_request_id(self) -> str:
        return str(next(self._ids))

    def process_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """Text and token ids of a prompt; raises ValueError naming what is wrong."""
        if isinstance(prompt, str):
            text, ids = prompt, self._tokenizer.encode(prompt, add_special_tokens=True)
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
        self._check_prompt_ids(ids)
        return text, ids

    def _check_prompt_ids(self, ids: list[int]) -> None:
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

    def add_request(
        self,
        request_id: str,
        prompt: PromptType | tuple[str | None, list[int]],
        params: SamplingParams,
    ) -> None:
        """Queue a request; `prompt` may already be processed (text, ids) by process_prompt."""
        self.check_params(params)
        text, ids = prompt if isinstance(prompt, tuple) else self.process_prompt(prompt)
        self._warn_if_cut(len(ids), params.max_tokens)
        children = {
            (request_id if params.n == 1 else f"{request_id}#{i}"): _child_params(params, i)
            for i in range(params.n)
        }
        self.processor.add_request(request_id, text, ids, children)
        eos = self.config.model_config.arch.eos_token_ids
        for child_id, child_params in children.items():
            self.core.add_request(Request(child_id, ids, child_params, eos_token_ids=eos))

    def _warn_if_cut(self, prompt_len: int, max_tokens: int | None) -> None:
        """Once per engine: max_tokens past max_model_len (the server answers it with a 400;
        offline, generation stops at max_model_len with finish_reason "length")."""
        room = self.config.model_config.max_model_len - prompt_len
        if max_tokens is None or max_tokens <= room or self._warned_max_tokens:
            return
        self._warned_max_tokens = True
        logger.warning(
            "max_tokens=%d does not fit: a %d-token prompt leaves %d of max_model_len=%d; such "
            "requests stop there with finish_reason 'length' (warned once)", max_tokens,
            prompt_len, room, self.config.model_config.max_model_len)

    def abort_request(self, request_ids: str | list[str]) -> list[RequestOutput]:
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        outputs = []
        for rid in request_ids:
            self.core.abort_requests(self.processor.child_ids(rid))
            out = self.processor.abort(rid)
            if out is not None:
                outputs.append(out)
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests() or self.processor.has_unfinished()

    def step(self) -> list[RequestOutput]:
        outputs, to_abort = self.processor.process(self.core.step())
        if to_abort:
            self.core.abort_requests(to_abort)
        return outputs

    def shutdown(self) -> None:
        self.core.shutdown()


def _child_params(params: SamplingParams, index: int) -> SamplingParams:
    """The params of sequence `index` of a request: n=1, and a distinct seed when seeded."""
    if params.n == 1:
        return params
    seed = None if params.seed is None else params.seed + index
    return dataclasses.replace(params, n=1, seed=seed)
