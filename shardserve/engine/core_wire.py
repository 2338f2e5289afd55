"""What crosses the ZMQ sockets between a front end and its engine-core processes.

    front end (MPClient, AsyncMPClient: replica_set.py)           engine core i (core_proc.py)
    ─────────────────────────────────────────────────             ────────────────────────────
    input socket i   PUSH, binds ipc://<dir>/in<i> ── EngineRequest ──▶ PULL, connects
                       "add" (request) | "abort" (request_ids)
                       | "utility" (UtilityCall) | "shutdown"
    output socket    PULL, binds ipc://<dir>/out  ◀── EngineOutputs ── PUSH, connects (all i)
                       outputs + SchedulerStats + engine_index
                       [+ UtilityResult] [+ dead_error]

One input socket per data-parallel replica, one output socket that every replica pushes to; each
message out names its replica (`engine_index`). Frames are pickles (`encode` / `decode`) of the
small dataclasses below. Every message out carries the scheduler's figures (and how many "add"
messages the core has applied, so the front end knows which of its adds they include): metrics
and load balancing never need a round trip. A utility call goes to each target replica with one
call id and is answered once by each.
"""

from __future__ import annotations

import itertools
import pickle
import time
from dataclasses import dataclass, field
from typing import Any

from shardserve.engine.input_processor import EngineCoreRequest
from shardserve.messages import EngineCoreOutput

# What a front end may call on an engine core by name ("utility" messages).
UTILITY_METHODS = frozenset({"sleep", "wake_up", "is_sleeping", "collective_rpc",
                             "start_profile", "stop_profile",
                             "add_lora", "remove_lora", "pin_lora", "list_loras"})


@dataclass
class UtilityCall:
    call_id: int
    method: str  # one of UTILITY_METHODS
    args: tuple = ()


@dataclass
class UtilityResult:
    call_id: int
    result: Any = None
    error: str | None = None  # the exception, as "Type: message"
    # The exception was a ValueError (bad input, e.g. an adapter refused at load): the caller
    # gets a ValueError, the engine is fine. Anything else comes back as a RuntimeError.
    bad_input: bool = False


@dataclass
class EngineRequest:
    """One message to the engine: "add" (request), "abort" (request_ids), "utility" (call) or
    "shutdown"."""

    kind: str
    request: EngineCoreRequest | None = None
    request_ids: list[str] = field(default_factory=list)
    call: UtilityCall | None = None


@dataclass
class SchedulerStats:
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0  # totals since start (tokens)
    prefix_cache_hits: int = 0
    requests_added: int = 0  # "add" messages applied since start
    # Speculative decoding, totals since start (engine/spec_decode_scheduling.py).
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = field(default_factory=list)
    kv_cache_capacity_tokens: int = 0  # what the KV cache holds (blocks x block_size x DCP)


def sum_stats(replicas: list[SchedulerStats]) -> SchedulerStats:
    """Data-parallel replicas' figures added up (KV usage: their mean)."""
    total = SchedulerStats()
    for s in replicas:
        for name in ("num_running", "num_waiting", "num_preemptions", "prefix_cache_queries",
                     "prefix_cache_hits", "requests_added", "spec_num_drafts",
                     "spec_num_draft_tokens", "spec_num_accepted_tokens",
                     "kv_cache_capacity_tokens"):
            setattr(total, name, getattr(total, name) + getattr(s, name))
        total.spec_accepted_per_pos = [
            a + b for a, b in itertools.zip_longest(total.spec_accepted_per_pos,
                                                    s.spec_accepted_per_pos, fillvalue=0)]
    total.kv_cache_usage = sum(s.kv_cache_usage for s in replicas) / max(1, len(replicas))
    return total


def scheduler_stats(core: Any, requests_added: int = 0) -> SchedulerStats:
    """The figures an EngineCore reports with every message."""
    sched = core.scheduler
    spec = sched.spec.stats
    return SchedulerStats(sched.num_running, sched.num_waiting, sched.kv.usage,
                          sched.total_preemptions, sched.kv.stats.queries, sched.kv.stats.hits,
                          requests_added, spec.num_drafts, spec.num_draft_tokens,
                          spec.num_accepted_tokens, list(spec.accepted_per_pos),
                          core.kv_cache_capacity_tokens)


@dataclass
class EngineOutputs:
    """One step's outputs (maybe none: a stats-only update), or the news that the engine died."""

    outputs: list[EngineCoreOutput]
    stats: SchedulerStats
    timestamp: float = field(default_factory=time.monotonic)
    dead_error: str | None = None
    engine_index: int = 0  # the data-parallel replica that sent it
    # Its engine-core process: a replica restarted after a death (replica_recovery.py) keeps its
    # index, so what its dead predecessor sent last is told apart by pid and dropped.
    pid: int = 0
    utility: UtilityResult | None = None  # the answer to a "utility" message


@dataclass(frozen=True)
class EngineAddresses:
    """One replica's two endpoints (its own input socket, the shared output socket)."""

    input_addr: str
    output_addr: str


SHUTDOWN = EngineRequest("shutdown")


def encode(msg: EngineRequest | EngineOutputs) -> bytes:
    return pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)


def decode(frame: Any) -> Any:
    """A message from a received frame (a zmq.Frame, or bytes)."""
    return pickle.loads(getattr(frame, "buffer", frame))
