"""The engine-core process: EngineCore in a busy loop, fed and drained over ZMQ.

    front end ──PUSH (EngineRequest)──▶ input socket i ──▶ engine core i: drain, step()
    front end ◀──PULL (EngineOutputs)── output socket ◀───┘   (every replica pushes to it)

The front end (the API server, or a multi-process client of `LLM`) binds the ipc:// sockets in
its private temp dir, one input socket per data-parallel replica and one output socket they all
connect to; each message out names its replica (`engine_index`). Messages are pickled small
dataclasses. Every message out carries the scheduler's stats (and how many requests the core
has taken in, so the front end knows which of its adds the figures include): /metrics and the
load balancing never need a round trip.

Liveness, both ways: the server watches this process's sentinel; this process polls the read end
of a "death pipe" whose write end only the server holds, so EOF there means the server is gone
and we shut down (stopping our executor's workers) instead of lingering.
"""

from __future__ import annotations

import logging
import os
import pickle
import shutil
import signal
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import zmq

from shardserve import envs
from shardserve.config import EngineConfig
from shardserve.engine.input_processor import EngineCoreRequest
from shardserve.messages import EngineCoreOutput

logger = logging.getLogger(__name__)

# Longest the idle loop blocks before re-checking the executor and the death pipe.
_IDLE_POLL_MS = 200


# What a front end may call on an engine core by name ("utility" messages).
UTILITY_METHODS = frozenset({"sleep", "wake_up", "is_sleeping", "collective_rpc"})


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


def sum_stats(replicas: list[SchedulerStats]) -> SchedulerStats:
    """Data-parallel replicas' figures added up (KV usage: their mean)."""
    total = SchedulerStats()
    for s in replicas:
        for name in ("num_running", "num_waiting", "num_preemptions", "prefix_cache_queries",
                     "prefix_cache_hits", "requests_added"):
            setattr(total, name, getattr(total, name) + getattr(s, name))
    total.kv_cache_usage = sum(s.kv_cache_usage for s in replicas) / max(1, len(replicas))
    return total


def scheduler_stats(core: Any, requests_added: int = 0) -> SchedulerStats:
    """The figures an EngineCore reports with every message."""
    sched = core.scheduler
    return SchedulerStats(sched.num_running, sched.num_waiting, sched.kv.usage,
                          sched.total_preemptions, sched.kv.stats.queries, sched.kv.stats.hits,
                          requests_added)


@dataclass
class EngineOutputs:
    """One step's outputs (maybe none: a stats-only update), or the news that the engine died."""

    outputs: list[EngineCoreOutput]
    stats: SchedulerStats
    timestamp: float = field(default_factory=time.monotonic)
    dead_error: str | None = None
    engine_index: int = 0  # the data-parallel replica that sent it
    utility: UtilityResult | None = None  # the answer to a "utility" message


@dataclass(frozen=True)
class EngineAddresses:
    input_addr: str
    output_addr: str


def run_engine_core(
    config: EngineConfig, addrs: EngineAddresses, ready: Connection, death: Connection,
    engine_index: int = 0,
) -> None:
    """Process entry point (spawn). Reports "ready" (or the start-up error) on `ready`."""
    # Ctrl-C reaches the whole process group: the API server coordinates shutdown, so we ignore
    # SIGINT; SIGTERM (sent to us alone) exits through the finally blocks below.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _raise_system_exit)
    logging.basicConfig(level=envs.log_level(),
                        format="%(asctime)s engine-core %(levelname)s %(name)s: %(message)s")
    _set_title("shardserve::engine_core" if engine_index == 0 else
               f"shardserve::engine_core_{engine_index}")
    from shardserve.engine.core import EngineCore

    try:
        core = EngineCore(config)
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which exits with it
        ready.send(("error", f"{type(e).__name__}: {e}"))
        return
    loop = None
    try:
        ready.send(("ready", core.kv_cache_config.num_blocks))
        loop = EngineCoreLoop(core, addrs, death, engine_index)
        loop.run()
    finally:
        core.shutdown()
        if loop is not None and loop.orphaned:  # the server cannot remove its socket dir now
            shutil.rmtree(os.path.dirname(addrs.input_addr.removeprefix("ipc://")),
                          ignore_errors=True)


def _raise_system_exit(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def _set_title(title: str) -> None:
    try:
        import setproctitle

        setproctitle.setproctitle(title)
    except ImportError:
        pass


class EngineCoreLoop:
    def __init__(self, core: Any, addrs: EngineAddresses, death: Connection,
                 engine_index: int = 0) -> None:
        self.core = core
        self.death = death
        self.engine_index = engine_index
        self.requests_added = 0
        self.orphaned = False  # the API server died without telling us
        self.ctx = zmq.Context()
        self.input = self.ctx.socket(zmq.PULL)
        self.input.connect(addrs.input_addr)
        self.output = self.ctx.socket(zmq.PUSH)
        self.output.connect(addrs.output_addr)
        # The executor's monitor thread reports a worker's death through this pipe, so an idle
        # loop wakes at once instead of at its next poll (sockets are not thread-safe; pipes are).
        self._wake_r, self._wake_w = os.pipe()
        core.executor.register_failure_callback(self._on_executor_failure)
        self.poller = zmq.Poller()
        self.poller.register(self.input, zmq.POLLIN)
        self.poller.register(self.death.fileno(), zmq.POLLIN)
        self.poller.register(self._wake_r, zmq.POLLIN)

    def _on_executor_failure(self) -> None:
        os.write(self._wake_w, b"x")

    def run(self) -> None:
        try:
            self._loop()
        finally:
            self.input.close(linger=0)
            self.output.close(linger=1000)  # let a final "dead" message reach the server
            self.ctx.term()
            os.close(self._wake_r)
            os.close(self._wake_w)

    def _loop(self) -> None:
        while True:
            busy = self.core.has_unfinished_requests()
            events = dict(self.poller.poll(0 if busy else _IDLE_POLL_MS))
            if self.death.fileno() in events:
                logger.info("the front end is gone; shutting down")
                self.orphaned = True
                return
            if self.core.executor.is_failed:
                self._report_dead("the executor failed (a worker died)")
                return
            changed, stop = self._drain_input()
            if stop:
                return
            if self.core.has_unfinished_requests():
                if not self._step():
                    return
            elif changed:
                self._send(EngineOutputs([], self._stats()))  # e.g. aborts freed KV blocks

    def _drain_input(self) -> tuple[bool, bool]:
        """Apply every queued message. Returns (anything applied, shutdown requested)."""
        changed = False
        while True:
            try:
                frame = self.input.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return changed, False
            msg: EngineRequest = pickle.loads(frame.buffer)
            changed = True
            if msg.kind == "add" and msg.request is not None:
                self.core.add_request(msg.request.to_request())
                self.requests_added += 1
            elif msg.kind == "abort":
                self.core.abort_requests(msg.request_ids)
            elif msg.kind == "utility" and msg.call is not None:
                self._send(EngineOutputs([], self._stats(), utility=self._call(msg.call)))
            elif msg.kind == "shutdown":
                return changed, True

    def _call(self, call: UtilityCall) -> UtilityResult:
        """Run a front end's call on the core; an error goes back to the caller, the engine
        stays up."""
        if call.method not in UTILITY_METHODS:
            return UtilityResult(call.call_id, error=f"ValueError: {call.method!r} is not one of "
                                                     f"{sorted(UTILITY_METHODS)}")
        try:
            if call.method == "collective_rpc":
                return UtilityResult(call.call_id, self.core.executor.collective_rpc(*call.args))
            return UtilityResult(call.call_id, getattr(self.core, call.method)(*call.args))
        except Exception as e:  # noqa: BLE001 - reported to the caller
            return UtilityResult(call.call_id, error=f"{type(e).__name__}: {e}")

    def _step(self) -> bool:
        """Run one step and send its outputs; False once the engine is dead (reported)."""
        try:
            outputs = self.core.step()
        except Exception as e:
            logger.exception("engine step failed; the engine is dead")
            self._report_dead(f"{type(e).__name__}: {e}")
            return False
        self._send(EngineOutputs(outputs, self._stats()))
        return True

    def _stats(self) -> SchedulerStats:
        return scheduler_stats(self.core, self.requests_added)

    def _report_dead(self, error: str) -> None:
        self._send(EngineOutputs([], self._stats(), dead_error=error))

    def _send(self, msg: EngineOutputs) -> None:
        msg.engine_index = self.engine_index
        self.output.send(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL), copy=False)
