"""The engine's view of one request: its tokens, progress and status (no torch here)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from shardserve.lora.request import LoRARequest
from shardserve.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def is_finished(self) -> bool:
        return self.value in ("stop", "length", "abort")


@dataclass(eq=False)  # identity: list.remove must not compare token lists
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    arrival_time: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    # Tokens whose K/V are in the cache or scheduled to be (advanced at scheduling time).
    num_computed_tokens: int = 0
    # Tokens scheduled to be sampled whose ids are not back yet (see scheduler.py).
    num_output_placeholders: int = 0
    # Draft positions of its steps in flight, counted in num_computed_tokens until the step is
    # folded in (then its rejected ones are rolled back; see spec_decode_scheduling.py).
    num_unverified_drafts: int = 0
    num_preemptions: int = 0
    # Output tokens the workers have been sent (pipeline parallelism: see the scheduler).
    num_output_tokens_sent: int = 0
    stop_reason: int | str | None = None
    # Structured outputs: the engine core's RequestGrammar (set on arrival there; never sent on).
    grammar: Any = None
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    priority: int = 0  # scheduling_policy="priority": lower runs first (request_queue.py)
    # Speculative decoding: drafts the workers proposed for the request's next step (verified
    # when scheduled; never part of its token ids), and its acceptance record
    # (engine/spec_decode_scheduling.py).
    spec_token_ids: list[int] = field(default_factory=list)
    spec: Any = None
    lora_request: LoRARequest | None = None  # None: the base model

    @property
    def lora_int_id(self) -> int:
        """The adapter's id, 0 for the base model (the scheduler's and the prefix cache's key)."""
        return self.lora_request.lora_int_id if self.lora_request is not None else 0

    @property
    def lora_key(self) -> str:
        """The prefix cache's key for its adapter ("" for the base model; see kv_cache.py)."""
        lora = self.lora_request
        return "" if lora is None else f"{lora.lora_int_id}:{lora.lora_path}"

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def max_output_tokens(self) -> int:
        return self.sampling_params.max_tokens or 1 << 30

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.is_finished else None
