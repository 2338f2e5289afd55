"""QueueRpc: collective_rpc over one broadcast MessageQueue and one reply queue per rank, for
every backend whose workers run `worker_main.run_busy_loop` (mp, its ranks on other nodes, and
ray_v2). It owns the queues, the ready handshake, the calls in flight and the close order.

    call() ──RpcRequest──▶ broadcast MessageQueue (1 → world_size) ──▶ rank busy loops
    ReplyFuture ◀──RpcReply── reply queue of each rank ◀─────────────────────────┘

The executors own the processes (how workers start, how a death is noticed and described);
that comes in as WorkerHooks. Life of one QueueRpc:
  1. created with the broadcast queue (the workers are started with its handle);
  2. `connect`: attach to every rank's reply queue, then wait for both handshakes;
  3. `call`, any number of times, from any thread;
  4. `shutdown(stop_workers)`: ask the workers to exit, let the executor stop the processes,
     then close every queue, unlink the reply rings (a killed worker could not) and fail the
     calls still pending.

Calls are answered in submission order. A call records which ranks must reply; on success only
`reply_rank` answers (execute_model: the output rank), but a failure on any rank always answers,
so an exception on a non-output rank reaches the caller instead of a timeout.
"""

from __future__ import annotations

import functools
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from shardserve.errors import EngineDeadError, WorkerStartupError
from shardserve.executor.reply_future import Gather, ReplyFuture, complete, settle
from shardserve.ipc import Handle, MessageQueue, MessageQueueReader, MessageQueueWriter, QueueClosed
from shardserve.ipc.rpc import SHUTDOWN, RpcReply, RpcRequest
from shardserve.ipc.segments import unlink_segment

logger = logging.getLogger(__name__)

SHUTDOWN_GRACE_S = 2.0  # how long workers asked to exit get before they are stopped by signal


@dataclass
class WorkerHooks:
    """How the owning executor reports on its workers (process sentinels, Ray refs...)."""

    raise_if_dead: Callable[[], None]  # raises EngineDeadError once the executor has failed
    death_reason: Callable[[], str | None]  # the recorded death, if any
    find_dead_worker: Callable[[float], str | None]  # waits up to s for a death; describes it
    unusual_workers: Callable[[], str] = lambda: ""  # "; rank 1 (pid 7) is stopped" or ""


@dataclass
class _PendingCall:
    call_id: int
    gather: Gather
    future: ReplyFuture


class QueueRpc:
    def __init__(self, world_size: int, n_local: int, connect_ip: str | None,
                 hooks: WorkerHooks) -> None:
        """The broadcast queue for `world_size` ranks, of which 0..n_local-1 read it through
        shared memory and the others over TCP, served at `connect_ip`."""
        self.world_size = world_size
        self.broadcast = MessageQueueWriter(world_size, n_local, connect_ip=connect_ip,
                                            name="rpc-broadcast")
        self.reply_handles: list[Handle] = []
        self.reply_queues: list[MessageQueueReader] = []
        self._hooks = hooks
        self.connected = False  # every rank reads the broadcast and we read every reply queue
        self._submit_lock = threading.Lock()
        self._collect_lock = threading.Lock()
        self._call_ids = itertools.count(1)
        self._pending: deque[_PendingCall] = deque()
        self._lookahead: dict[int, RpcReply] = {}
        self._failed_calls: set[int] = set()  # their other ranks' late errors are expected

    # ---- the ready handshake ----
    def connect(self, reply_handles: list[Handle], timeout_s: float,
                abort: Callable[[], str | None] = lambda: None) -> None:
        """Attach to every rank's reply queue, then wait for both handshakes. `abort` names a
        failure that makes waiting pointless (a lost node): checked twice a second.

        Ordering: attach to the reply queues before waiting on the broadcast queue; each worker
        waits for the broadcast handshake before it waits for our attachment.
        """
        self.reply_handles = list(reply_handles)
        self.reply_queues = [
            MessageQueueReader.from_handle(h, 0, name=f"replies-from-TP{rank}")
            for rank, h in enumerate(self.reply_handles)
        ]
        deadline = time.monotonic() + timeout_s
        for mq in [self.broadcast, *self.reply_queues]:
            _wait_ready(mq, deadline, abort)
        self.connected = True

    # ---- calls ----
    def call(
        self,
        method: str | Callable[..., Any],
        timeout: float | None = None,
        args: tuple = (),
        kwargs: dict[str, Any] | None = None,
        non_block: bool = False,
        unique_reply_rank: int | None = None,
    ) -> Any:
        """collective_rpc over the queues (see Executor.collective_rpc)."""
        self._hooks.raise_if_dead()  # the one check on the way in: executors forward here
        if not self.connected:
            raise EngineDeadError("the workers are not connected (start-up failed or shut down)")
        ranks = range(self.world_size) if unique_reply_rank is None else [unique_reply_rank]
        gather = Gather.of(method, ranks, timeout, unique_reply_rank)
        future = ReplyFuture(self._wait_for)
        with self._submit_lock:  # call ids, the pending order and the broadcast agree
            call = _PendingCall(next(self._call_ids), gather, future)
            request = RpcRequest(call.call_id, RpcRequest.encode_method(method), args,
                                 kwargs or {}, unique_reply_rank)
            self._pending.append(call)
            self._send(request, timeout)
        return future if non_block else future.result()

    def _send(self, request: RpcRequest, timeout: float | None) -> None:
        try:
            self.broadcast.enqueue(request, timeout=timeout)
        except QueueClosed as e:
            raise EngineDeadError(
                self._hooks.death_reason() or f"the broadcast queue closed: {e}"
            ) from e

    def _wait_for(self, target: ReplyFuture, timeout: float | None) -> None:
        """Complete pending calls in submission order until `target` is done."""
        wait_deadline = None if timeout is None else time.monotonic() + timeout
        with self._collect_lock:
            while not target.done():
                call = self._pending[0]
                try:
                    settle(call.future, call.gather.deadline,
                           functools.partial(self._collect, call, wait_deadline))
                finally:  # a TimeoutError of this wait alone leaves the call pending
                    if call.future.done():
                        self._pending.popleft()
                        if call.future.exception(timeout=0) is not None:
                            self._failed_calls.add(call.call_id)

    def _collect(self, call: _PendingCall, wait_deadline: float | None) -> Any:
        def receive(missing: list[int], slice_s: float) -> None:
            if not self._receive(missing[0], call, slice_s):
                # Nothing from the rank we wait on: a failure may have come from another rank.
                for rank in range(self.world_size):
                    if rank != missing[0]:
                        self._receive(rank, call, 0.0)

        return call.gather.wait(receive, wait_deadline, self._hooks.raise_if_dead,
                                self._hooks.unusual_workers)

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
            error = reply.error.to_exception(call.gather.method)
            # A dying peer closes its sockets as it exits, so when an error is a broken
            # collective its cause shows up within milliseconds: a short look suffices.
            dead = self._hooks.find_dead_worker(0.2)
            if dead is not None:  # e.g. a collective broken by a peer's death: name the cause
                raise EngineDeadError(self._hooks.death_reason() or dead) from error
            raise error
        if reply.call_id == call.call_id:
            call.gather.results[rank] = reply.value
        return True  # a stale success reply (of a timed-out call) is dropped

    # ---- the close order ----
    def shutdown(self, stop_workers: Callable[[float], None], ask: bool = True) -> None:
        """Ask the workers to exit (if connected and `ask`), `stop_workers(grace_s)` (the
        executor's: wait up to grace_s, then signals), then close everything of ours."""
        asked = ask and self.connected and self._ask_workers_to_exit()
        try:
            stop_workers(SHUTDOWN_GRACE_S if asked else 0.0)
        finally:
            self._close()

    def _ask_workers_to_exit(self) -> bool:
        """Broadcast the shutdown request; False if it could not be sent (a stuck worker's full
        ring, or a closed queue): the workers are then stopped by signal at once."""
        try:
            self.broadcast.enqueue(RpcRequest(0, SHUTDOWN, (), {}), timeout=1.0)
            return True
        except Exception as e:
            logger.warning("could not ask the workers to exit (%s); stopping them", e)
            return False

    def _close(self) -> None:
        """After the workers are stopped: close every queue, unlink the reply rings (a killed
        worker could not), and fail the calls still pending."""
        self.connected = False
        for mq in [*self.reply_queues, self.broadcast]:
            mq.close()
        for h in self.reply_handles:
            unlink_segment(h.shm_name)
        error = EngineDeadError("the executor was shut down")
        for call in self._pending:
            complete(call.future, error=error)


def _wait_ready(mq: MessageQueue, deadline: float, abort: Callable[[], str | None]) -> None:
    while True:
        if (why := abort()) is not None:
            raise WorkerStartupError(why)
        try:
            mq.wait_until_ready(timeout=max(0.0, min(0.5, deadline - time.monotonic())))
            return
        except TimeoutError:
            if time.monotonic() >= deadline:
                raise
