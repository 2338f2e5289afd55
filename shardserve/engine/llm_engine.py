"""LLMEngine: the synchronous front end — input checks, tokenization, outputs — over its engine
cores: one in this process, or `data_parallel_size` in processes of their own (core_client.py).

Everything that can be wrong with a request is checked here, before it reaches a core, so a bad
request raises a ValueError for its caller and never disturbs the requests already running.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable
from typing import Any

from shardserve.config import EngineConfig
from shardserve.engine.core import EngineCore
from shardserve.engine.core_client import EngineCoreClient
from shardserve.engine.dp_router import resized
from shardserve.engine.inproc_client import InprocClient, make_client
from shardserve.engine.input_processor import EngineCoreRequest, InputProcessor, PromptType
from shardserve.engine.lora_requests import FrontEndLoRAs
from shardserve.engine.output_processor import OutputProcessor
from shardserve.engine.replica_recovery import EngineRestart, resumed_open
from shardserve.errors import EngineDeadError
from shardserve.lora.request import LoRARequest
from shardserve.model.tokenizer import EngineTokenizer
from shardserve.outputs import RequestOutput
from shardserve.sampling_params import SamplingParams

__all__ = ["LLMEngine", "PromptType"]

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig, stream: bool = False) -> None:
        self.config = config
        # Encodes and detokenizes without transformers where it can (a cold start's first
        # token does not wait for it); `tokenizer` is the transformers one, built on first use.
        self._tokenizer = EngineTokenizer(config.model_config.tokenizer_path,
                                          config.model_config.trust_remote_code)
        self.inputs = InputProcessor(config, self._tokenizer)
        self.client: EngineCoreClient = make_client(config)
        self.processor = OutputProcessor(self._tokenizer, stream=stream)
        self._ids = itertools.count()
        self._warned_max_tokens = False
        # Open requests as sent, to re-add them after a restart (max_engine_restarts).
        self._sent: dict[str, list[EngineCoreRequest]] = {}
        self.restart = EngineRestart(config.recovery_config)
        # The client may be replaced (scale()): reach it through self.client at each call.
        self.loras = FrontEndLoRAs(config, lambda method, *args: self.client.call(method, *args))

    @classmethod
    def from_engine_args(cls, engine_args: Any) -> LLMEngine:
        """vLLM's constructor: from an EngineArgs (shardserve.EngineArgs)."""
        return cls(engine_args.create_engine_config())

    @property
    def core(self) -> EngineCore:
        """The engine core, where it runs in this process (data_parallel_size=1)."""
        if not isinstance(self.client, InprocClient):
            raise RuntimeError(
                f"with data_parallel_size={self.config.parallel_config.data_parallel_size} the "
                f"engine cores run in processes of their own; there is no in-process core")
        return self.client.core

    @property
    def tokenizer(self) -> Any:
        """The model's transformers tokenizer (what `load_tokenizer` returns)."""
        return self._tokenizer.full

    @property
    def vocab_size(self) -> int:
        return self.config.model_config.arch.vocab_size

    def next_request_id(self) -> str:
        return str(next(self._ids))

    def process_prompt(self, prompt: PromptType, truncate_prompt_tokens: int | None = None
                       ) -> tuple[str | None, list[int]]:
        """Text and token ids of a prompt; raises ValueError naming what is wrong."""
        return self.inputs.process_prompt(prompt, truncate_prompt_tokens)

    def check_params(self, params: SamplingParams) -> None:
        """ValueError for params this engine cannot run (see InputProcessor.check_params)."""
        self.inputs.check_params(params)

    def add_request(
        self,
        request_id: str,
        prompt: PromptType | tuple[str | None, list[int]],
        params: SamplingParams,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Queue a request; `prompt` may already be processed (text, ids) by process_prompt.
        `priority` needs scheduling_policy="priority" (lower value first); `lora_request`
        enable_lora (its adapter is loaded first, if it is not yet)."""
        self.load_loras([lora_request])
        req = self.inputs.process(request_id, prompt, params, priority, lora_request)
        self._warn_if_cut(len(req.prompt_token_ids), params.max_tokens)
        self.processor.add_request(request_id, req.prompt, req.prompt_token_ids, req.children)
        self._sent[request_id] = req.core_requests()
        self.client.add_requests(self._sent[request_id])
        if self.restart.enabled:
            self.restart.ledger.sent(request_id, 0)

    # ---- LoRA adapters (see lora_requests.py) ----
    def load_loras(self, lora_requests: Iterable[LoRARequest | None]) -> None:
        """Load those of the adapters not loaded yet (every rank of every engine core)."""
        self.loras.load(lora_requests)

    def add_lora(self, lora_request: LoRARequest) -> bool:
        return self.loras.add(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        return self.loras.remove(lora_int_id)

    def pin_lora(self, lora_int_id: int) -> bool:
        return self.loras.pin(lora_int_id)

    def list_loras(self) -> set[int]:
        return self.loras.list()

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
            self.client.abort_requests(self.processor.child_ids(rid))
            self._sent.pop(rid, None)
            self.restart.ledger.forget(rid)
            out = self.processor.abort(rid)
            if out is not None:
                outputs.append(out)
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.client.has_unfinished_requests() or self.processor.has_unfinished()

    def step(self) -> list[RequestOutput]:
        try:
            core_outputs = self.client.get_output()
        except EngineDeadError as e:
            return self._restart_after(e)
        outputs, to_abort = self.processor.process(core_outputs)
        if to_abort:
            self.client.abort_requests(to_abort)
        for out in outputs:
            if out.finished:
                self._sent.pop(out.request_id, None)
                self.restart.ledger.forget(out.request_id)
        if self.restart.ledger.probation is not None or self.restart.ledger.suspects:
            self._release_suspect()
        return outputs

    def _restart_after(self, error: EngineDeadError) -> list[RequestOutput]:
        """The engine died: with restarts allowed (replica_recovery.EngineRestart), start it
        again and re-add every open request where it stopped; else raise the error. Returns
        the outputs of requests given up (finish_reason 'abort'; migration_ledger.py)."""
        if not self.restart.allows():
            raise error
        logger.error("the engine died (%s); restarting it and re-adding %d open requests",
                     error, len(self._sent))
        replicas = self.client.num_replicas  # as many as it ran (LLM.scale may have changed it)
        self.client.shutdown()
        self.restart.backoff()
        self.client = make_client(resized(self.config, replicas))
        give_up, move = self.restart.ledger.on_death(list(self._sent), self._tokens)
        ended = []
        for parent in give_up:
            logger.error("request %s died with the engine %d times before it produced a token; "
                         "it ends with finish_reason 'abort' (max_request_migrations=%d)", parent,
                         self.config.recovery_config.max_request_migrations + 1,
                         self.config.recovery_config.max_request_migrations)
            del self._sent[parent]
            if (out := self.processor.abort(parent)) is not None:
                ended.append(out)
        for parent in move:
            self._resend(parent)
        self._release_suspect()
        return ended

    def _tokens(self, parent: str) -> int:
        return self.processor.num_tokens(parent) or 0

    def _resend(self, parent: str) -> None:
        moved = resumed_open(self._sent[parent], self.processor)
        self.restart.ledger.sent(parent, self._tokens(parent))
        if moved:
            self.client.add_requests(moved)

    def _release_suspect(self) -> None:
        """The next request held after a death, once the one on probation made progress."""
        parent = self.restart.ledger.release(
            lambda p: self._tokens(p) if p in self._sent else None)
        if parent is not None and parent in self._sent:
            self._resend(parent)

    def shutdown(self) -> None:
        self.client.shutdown()

