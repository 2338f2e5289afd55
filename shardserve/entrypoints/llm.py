"""LLM: the offline API — `LLM(...).generate(prompts, params)` — shaped like vLLM's."""

from __future__ import annotations

import atexit
import logging
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from tqdm import tqdm

from shardserve.engine.config_builder import engine_config_from_kwargs
from shardserve.engine.core_wire import sum_stats
from shardserve.engine.llm_engine import LLMEngine, PromptType
from shardserve.engine.pooling import embedding_output, pooling_params_list
from shardserve.entrypoints.beam_search import BeamSearchOutput, run_beam_search
from shardserve.lora.request import LoRARequest
from shardserve.model.loader import generation_defaults
from shardserve.outputs import EmbeddingRequestOutput, RequestOutput
from shardserve.pooling_params import PoolingParams
from shardserve.sampling_params import BeamSearchParams, SamplingParams
from shardserve.worker import profiler
from shardserve.worker.profiler import ProfilerConfig

logger = logging.getLogger(__name__)

Message = dict[str, Any]


class _ProgressBar(tqdm):
    """tqdm without its monitor thread: that thread outlives the bar, and a Python thread
    left running makes the next engine of the script start its mp workers with spawn (a
    fresh interpreter each, and the script re-imported) instead of fork (start_method.py)."""

    monitor_interval = 0


class LLM:
    """An engine for offline batch generation.

    Args:
        model: an HF model folder or a .gguf file; None for the default model.
        **engine_options: dtype, max_model_len, max_num_seqs, tensor_parallel_size,
            distributed_executor_backend, seed, ... (see config.py for all of them).
    """

    def __init__(self, model: str | None = None, **engine_options: Any) -> None:
        # vLLM's profiler_config={"profiler": "torch", "torch_profiler_dir": DIR} (a front-end
        # setting: it travels with start_profile to the cores and ranks).
        self._profiler_config = ProfilerConfig.parse(engine_options.pop("profiler_config", None))
        self.config = engine_config_from_kwargs(model, **engine_options)
        self.engine = LLMEngine(self.config)
        # Runs on shutdown(), on garbage collection and at interpreter exit, whichever is first.
        self._finalizer = weakref.finalize(self, self.engine.shutdown)
        # weakref's own exit hook may have been registered before Ray's (atexit runs last-in
        # first-out), and then it would shut us down after Ray has gone: a hook of our own,
        # registered after the engine (and Ray) started, runs first.
        atexit.register(self._finalizer)

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., tqdm] = True,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """One RequestOutput per prompt, in input order. `priority`: one int per prompt, lower
        first (needs scheduling_policy="priority"). `lora_request`: the adapter of every
        prompt, or one per prompt (None: the base model); needs enable_lora=True."""
        prompt_list = _as_prompt_list(prompts)
        params_list = self._params_list(sampling_params, len(prompt_list))
        priorities = self._priority_list(priority, len(prompt_list))
        loras = _lora_list(lora_request, len(prompt_list))
        # Check every prompt before queueing any, so a bad one leaves the engine untouched.
        for params in params_list:
            self.engine.check_params(params)
        processed = [self.engine.process_prompt(p, params.truncate_prompt_tokens)
                     for p, params in zip(prompt_list, params_list, strict=True)]
        self.engine.load_loras(loras)  # a refused adapter raises before anything is queued
        ids = []
        for prompt, params, prio, lora in zip(processed, params_list, priorities, loras,
                                              strict=True):
            ids.append(self.engine.next_request_id())
            self.engine.add_request(ids[-1], prompt, params, prio, lora)
        try:
            finished = self._run_engine(len(ids), use_tqdm)
        except BaseException:
            self.engine.abort_request(ids)
            raise
        return [finished[i] for i in ids]

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Apply the chat template (the model's, or `chat_template`) to each conversation, then
        generate. Message content may be a string or OpenAI-style text parts; `tools` go to the
        template; `continue_final_message` leaves the last (assistant) message open."""
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message=True needs add_generation_prompt=False: "
                             "the last message is continued, not answered")
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        kwargs = dict(chat_template_kwargs or {})
        if chat_template is not None:
            kwargs["chat_template"] = chat_template
        if tools is not None:
            kwargs["tools"] = tools
        prompts = []
        for conv in conversations:
            if not conv:
                raise ValueError("messages is empty; give at least one {'role', 'content'} dict")
            text = self.engine.tokenizer.apply_chat_template(
                [_plain_message(m) for m in conv],
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                tokenize=False,
                **kwargs,
            )
            # The template writes the special tokens itself.
            ids = self.engine.tokenizer.encode(text, add_special_tokens=False)
            prompts.append({"prompt": text, "prompt_token_ids": ids})
        return self.generate(prompts, sampling_params, use_tqdm, priority, lora_request)

    def beam_search(self, prompts: PromptType | Sequence[PromptType], params: BeamSearchParams,
                    *, use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """vLLM's beam search: one BeamSearchOutput per prompt, its best `beam_width`
        sequences first (see entrypoints/beam_search.py)."""
        return run_beam_search(self, _as_prompt_list(prompts), params, use_tqdm)

    def embed(self, prompts: PromptType | Sequence[PromptType],
              pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
              use_tqdm: bool | Callable[..., tqdm] = True,
              truncate_prompt_tokens: int | None = None) -> list[EmbeddingRequestOutput]:
        """vLLM's embed (needs runner="pooling"): one EmbeddingRequestOutput per prompt, its
        `.outputs.embedding` pooled as the engine's pooler_config says (see
        engine/pooling.py); batched with the same scheduler as generation."""
        prompt_list = _as_prompt_list(prompts)
        params = pooling_params_list(self.config, pooling_params, len(prompt_list),
                                     truncate_prompt_tokens)
        return [embedding_output(out) for out in self.generate(prompt_list, params, use_tqdm)]

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's own defaults (its generation_config.json:
        temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens), as vLLM's."""
        return SamplingParams(**generation_defaults(self.config.model_config.path))

    def _params_list(
        self, sampling_params: SamplingParams | dict | Sequence[SamplingParams | dict] | None,
        n: int,
    ) -> list[SamplingParams]:
        if sampling_params is None:
            return [self.get_default_sampling_params()] * n
        if isinstance(sampling_params, (SamplingParams, dict)):
            return [_as_params(sampling_params)] * n
        params = [_as_params(p) for p in sampling_params]
        if len(params) != n:
            raise ValueError(f"got {len(params)} sampling_params for {n} prompts; give 1 or {n}")
        return params

    def _priority_list(self, priority: Sequence[int] | None, n: int) -> list[int]:
        """One checked priority per prompt (all 0 when not given)."""
        if priority is None:
            return [0] * n
        if isinstance(priority, (int, str)) or not isinstance(priority, Sequence):
            raise ValueError(f"priority must be a list of ints, one per prompt, got {priority!r}")
        if len(priority) != n:
            raise ValueError(f"got {len(priority)} priorities for {n} prompts; give one per "
                             f"prompt")
        return [self.engine.inputs.check_priority(p) for p in priority]

    def _run_engine(self, num_requests: int, use_tqdm: bool | Callable) -> dict[str, RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm and num_requests > 1:
            make = use_tqdm if callable(use_tqdm) else _ProgressBar
            bar = make(total=num_requests, desc="Generating", unit="req", dynamic_ncols=True)
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        finished[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        finally:
            if bar is not None:
                bar.close()
        return finished

    def get_metrics(self) -> dict[str, Any]:
        """Engine counters since start: prefix-cache queries and hits (prompt tokens) and the
        hit rate, preemptions, running and waiting requests, the KV cache's capacity in tokens
        (blocks x block_size x decode_context_parallel_size), and speculative decoding's verify
        steps, drafted and accepted tokens, accepted drafts per position (a list), acceptance
        rate and mean acceptance length (tokens a verify step emits: 1 + accepted / steps)
        (summed over data-parallel replicas, as they last reported)."""
        total = sum_stats(self.engine.client.stats())
        queries, hits = total.prefix_cache_queries, total.prefix_cache_hits
        steps, drafted = total.spec_num_drafts, total.spec_num_draft_tokens
        accepted = total.spec_num_accepted_tokens
        return {"prefix_cache_queries": queries, "prefix_cache_hits": hits,
                "prefix_cache_hit_rate": hits / queries if queries else 0.0,
                "num_preemptions": total.num_preemptions,
                "num_requests_running": total.num_running,
                "num_requests_waiting": total.num_waiting,
                "kv_cache_capacity_tokens": total.kv_cache_capacity_tokens,
                "spec_decode_num_drafts": steps, "spec_decode_num_draft_tokens": drafted,
                "spec_decode_num_accepted_tokens": accepted,
                "spec_decode_num_accepted_tokens_per_pos": total.spec_accepted_per_pos,
                "spec_decode_acceptance_rate": accepted / drafted if drafted else 0.0,
                "spec_decode_mean_acceptance_length": 1 + accepted / steps if steps else 0.0}

    def collective_rpc(
        self, method: str | Callable, timeout: float | None = None, args: tuple = (), kwargs=None
    ) -> list[Any]:
        """Call a method on every worker (a name, or a callable taking the worker first); with
        data parallelism, every replica's workers in replica order (a callable must then be
        importable by name in the engine processes, e.g. a module-level function)."""
        per_replica = self.engine.client.call("collective_rpc", method, timeout, args, kwargs)
        return [result for replica in per_replica for result in replica]

    def scale(self, data_parallel_size: int) -> None:
        """Run with `data_parallel_size` engine replicas from now on. With replicas in processes
        (data_parallel_size > 1 at start) they are added or removed live, a removed one first
        finishing what it runs. An engine started with one in-process core moves to engine
        processes (it must be idle: its model is loaded again there)."""
        self.engine.client = self.engine.client.scale(data_parallel_size)

    def sleep(self, level: int = 1) -> None:
        self.engine.client.call("sleep", level)

    # LoRA adapters (needs enable_lora=True), as vLLM's LLM: loaded on every rank.
    def add_lora(self, lora_request: LoRARequest) -> bool:
        return self.engine.add_lora(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        return self.engine.remove_lora(lora_int_id)

    def pin_lora(self, lora_int_id: int) -> bool:
        return self.engine.pin_lora(lora_int_id)

    def list_loras(self) -> set[int]:
        return self.engine.list_loras()

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.engine.client.call("wake_up", tags)

    def start_profile(self) -> None:
        """Start torch's profiler on every rank and engine core (needs profiler_config when the
        LLM is made); a second start while one runs is refused."""
        self.engine.client.call("start_profile", profiler.required(self._profiler_config, "LLM"))

    def stop_profile(self) -> list[str]:
        """Stop the profile: each rank and engine core writes its Chrome trace (for Perfetto)
        to the profiler's folder; returns their paths."""
        return [path for core in self.engine.client.call("stop_profile") for path in core]

    def shutdown(self) -> None:
        self._finalizer()


def _as_params(params: SamplingParams | dict) -> SamplingParams:
    """SamplingParams, or a dict of its fields (a ValueError naming an unknown one)."""
    if not isinstance(params, dict):
        return params
    try:
        return SamplingParams(**params)
    except TypeError as e:
        raise ValueError(f"sampling_params: {e}") from e


def _lora_list(lora_request: LoRARequest | Sequence[LoRARequest | None] | None,
               n: int) -> list[LoRARequest | None]:
    """One adapter (or None) per prompt; checked further by the engine."""
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * n
    if isinstance(lora_request, (str, bytes)) or not isinstance(lora_request, Sequence):
        raise ValueError(f"lora_request must be a LoRARequest, a list of them (one per prompt) "
                         f"or None, got {type(lora_request).__name__}")
    if len(lora_request) != n:
        raise ValueError(f"got {len(lora_request)} lora_requests for {n} prompts; give 1 or {n}")
    return list(lora_request)


def _plain_message(message: Message) -> dict[str, Any]:
    """A message whose content is a string: OpenAI-style text parts are joined; other parts
    (images, audio) are refused, naming them."""
    content = message.get("content")
    if not isinstance(content, list):
        return dict(message)
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text":
            raise ValueError(f"message content part of type {kind!r} is not supported; this "
                             f"engine takes text parts ({{'type': 'text', 'text': ...}})")
        texts.append(part["text"])
    return {**message, "content": "".join(texts)}


def _as_prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt given as token ids
    return prompts
