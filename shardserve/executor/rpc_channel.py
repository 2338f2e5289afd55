"""RpcChannel: collective_rpc over one broadcast MessageQueue and one reply queue per rank.

    call() ──RpcRequest──▶ broadcast MessageQueue (1 → world_size) ──▶ rank busy loops
    _PendingCall ◀─RpcReply── reply_queues[rank] ◀──────────────────────────────┘

Shared by every backend whose workers run `worker_main.run_busy_loop` (mp, ray_v2); what differs
between them (how a worker's death is noticed and described) comes in as callables.

Calls are answered in submission order. A call records which ranks must reply; on success only
`reply_rank` answers (execute_model: the output rank), but a failure on any rank always answers,
so an exception on a non-output rank reaches the caller instead of a timeout.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from shardserve import envs
from shardserve.errors import EngineDeadError
from shardserve.ipc import MessageQueueReader, MessageQueueWriter, QueueClosed
from shardserve.ipc.rpc import RpcReply, RpcRequest

logger = logging.getLogger(__name__)

_POLL_S = 0.1  # longest a collecting thread goes without checking for dead workers


@dataclass
class _PendingCall:
    call_id: int
    method: str
    expected: frozenset[int]  # ranks whose successful reply completes the call
    deadline: float | None
    unique_reply_rank: int | None
    future: Future = field(default_factory=Future)
    results: dict[int, Any] = field(default_factory=dict)


class _CallFuture(Future):
    """A Future whose result() collects replies (and earlier calls' replies) in this thread."""

    def __init__(self, channel: RpcChannel, call: _PendingCall) -> None:
        super().__init__()
        self._channel = channel
        self._call = call

    def result(self, timeout: float | None = None) -> Any:
        self._channel._collect_until(self._call, timeout)
        return self._call.future.result(timeout=0)

    def done(self) -> bool:
        return self._call.future.done()


@dataclass
class WorkerHooks:
    """How the owning executor reports on its workers (process sentinels, Ray refs...)."""

    raise_if_dead: Callable[[], None]  # raises EngineDeadError once the executor has failed
    death_reason: Callable[[], str | None]  # the recorded death, if any
    find_dead_worker: Callable[[float], str | None]  # waits up to s for a death; describes it
    unusual_workers: Callable[[], str] = lambda: ""  # "; rank 1 (pid 7) is stopped" or ""


class RpcChannel:
    def __init__(
        self,
        broadcast: MessageQueueWriter,
        reply_queues: list[MessageQueueReader],
        hooks: WorkerHooks,
    ) -> None:
        self.broadcast = broadcast
        self.reply_queues = reply_queues
        self.world_size = len(reply_queues)
        self._hooks = hooks
        self._submit_lock = threading.Lock()
        self._collect_lock = threading.Lock()
        self._call_ids = itertools.count(1)
        self._pending: deque[_PendingCall] = deque()
        self._lookahead: dict[int, RpcReply] = {}
        self._failed_calls: set[int] = set()  # their other ranks' late errors are expected

    def call(
        self,
        method: str | Callable[..., Any],
        timeout: float | None,
        args: tuple,
        kwargs: dict[str, Any] | None,
        non_block: bool,
        unique_reply_rank: int | None,
    ) -> Any:
        """collective_rpc: broadcast one request and collect the replies (see Executor)."""
        self._hooks.raise_if_dead()
        name = method if isinstance(method, str) else getattr(method, "__name__", "callable")
        expected = (
            frozenset(range(self.world_size))
            if unique_reply_rank is None
            else frozenset([unique_reply_rank])
        )
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._submit_lock:
            call = _PendingCall(next(self._call_ids), name, expected, deadline, unique_reply_rank)
            request = RpcRequest(
                call.call_id,
                RpcRequest.encode_method(method),
                args,
                kwargs or {},
                unique_reply_rank,
            )
            self._pending.append(call)
            self._send(request, timeout)
        future = _CallFuture(self, call)
        return future if non_block else future.result()

    def fail_pending(self, error: BaseException) -> None:
        """Complete every call still waiting with `error` (the executor is shutting down)."""
        for call in self._pending:
            if not call.future.done():
                call.future.set_exception(error)

    def _send(self, request: RpcRequest, timeout: float | None) -> None:
        try:
            self.broadcast.enqueue(request, timeout=timeout)
        except QueueClosed as e:
            raise EngineDeadError(
                self._hooks.death_reason() or f"the broadcast queue closed: {e}"
            ) from e

    def _collect_until(self, target: _PendingCall, timeout: float | None) -> None:
        """Complete pending calls in submission order until `target` is done."""
        wait_deadline = None if timeout is None else time.monotonic() + timeout
        with self._collect_lock:
            while not target.future.done():
                call = self._pending[0]
                try:
                    self._collect(call, wait_deadline)
                except TimeoutError as e:
                    if not _passed(call.deadline):
                        raise  # only this wait timed out; the call stays pending
                    self._fail(call, e)
                except BaseException as e:
                    self._fail(call, e)
                if call.future.done():
                    self._pending.popleft()

    def _fail(self, call: _PendingCall, error: BaseException) -> None:
        self._failed_calls.add(call.call_id)
        call.future.set_exception(error)

    def _collect(self, call: _PendingCall, wait_deadline: float | None) -> None:
        start = time.monotonic()
        next_warning = start + envs.rpc_stall_warning_s()
        while missing := sorted(call.expected - call.results.keys()):
            self._hooks.raise_if_dead()
            deadline = _earliest(call.deadline, wait_deadline)
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                raise TimeoutError(
                    f"{call.method}() got no reply from worker ranks {missing} within "
                    f"{now - start:.1f} s{self._hooks.unusual_workers()} "
                    f"(parallel_config.execute_timeout_s bounds model steps)"
                )
            if now >= next_warning:
                logger.warning(
                    "%s() still waiting on ranks %s after %.0f s", call.method, missing, now - start
                )
                next_warning = now + envs.rpc_stall_warning_s()
            slice_s = _POLL_S if deadline is None else max(0.0, min(_POLL_S, deadline - now))
            if not self._receive(missing[0], call, slice_s):
                # Nothing from the rank we wait on: a failure may have come from another rank.
                for rank in range(self.world_size):
                    if rank != missing[0]:
                        self._receive(rank, call, 0.0)
        if call.unique_reply_rank is not None:
            call.future.set_result(call.results[call.unique_reply_rank])
        else:
            call.future.set_result([call.results[r] for r in range(self.world_size)])

    def _receive(self, rank: int, call: _PendingCall, timeout: float) -> bool:
        """Read one reply from `rank` into `call`; False when none came within `timeout`."""
        reply = self._lookahead.pop(rank, None)
        if reply is None:
            try:
                reply = self.reply_queues[rank].dequeue(timeout=timeout)
            except QueueClosed as e:
                raise EngineDeadError(
                    self._hooks.death_reason() or f"rank {rank}'s reply queue closed: {e}"
                ) from e
            except TimeoutError:
                return False
        if reply.call_id > call.call_id:
            self._lookahead[rank] = reply  # belongs to a later call
            return False
        if reply.error is not None and reply.call_id not in self._failed_calls:
            # An error of this call, or of an earlier one that completed without it (a
            # non-output rank failing after the output rank answered): surface it now.
            error = reply.error.to_exception(call.method)
            # A dying peer closes its sockets as it exits, so when an error is a broken
            # collective its cause shows up within milliseconds: a short look suffices.
            dead = self._hooks.find_dead_worker(0.2)
            if dead is not None:  # e.g. a collective broken by a peer's death: name the cause
                raise EngineDeadError(self._hooks.death_reason() or dead) from error
            raise error
        if reply.call_id == call.call_id:
            call.results[rank] = reply.value
        return True  # a stale success reply (of a timed-out call) is dropped


def _earliest(a: float | None, b: float | None) -> float | None:
    if a is None:
        return b
    return a if b is None else min(a, b)


def _passed(deadline: float | None) -> bool:
    return deadline is not None and time.monotonic() >= deadline
