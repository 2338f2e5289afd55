"""MultiprocExecutor: one worker process per rank, fed by the shared-memory broadcast queue.

    collective_rpc ──RpcRequest──▶ broadcast MessageQueue (1 → world_size) ──▶ rank busy loops
    _PendingCall  ◀──RpcReply──── one reply MessageQueue per rank ◀────────────────┘

Calls are answered in submission order. A call records which ranks must reply; on success only
`reply_rank` answers (execute_model: the output rank), but a failure on any rank always answers,
so an exception on a non-output rank reaches the caller instead of a timeout. Process start-up,
death watch and staged stop live in worker_process.py.
"""

from __future__ import annotations

import itertools
import logging
import os
import shutil
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from typing import Any

import psutil

from shardserve import envs
from shardserve.executor.abstract import EngineDeadError, Executor
from shardserve.executor.rpc import SHUTDOWN, RpcReply, RpcRequest
from shardserve.executor.worker_process import (
    WorkerHandle,
    WorkerMonitor,
    start_workers,
    stop_workers,
    wait_for_ready,
)
from shardserve.ipc import MessageQueue, QueueClosed

logger = logging.getLogger(__name__)

_POLL_S = 0.1  # longest a collecting thread goes without checking for dead workers
_SHUTDOWN_GRACE_S = 2.0


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

    def __init__(self, executor: MultiprocExecutor, call: _PendingCall) -> None:
        super().__init__()
        self._executor = executor
        self._call = call

    def result(self, timeout: float | None = None) -> Any:
        self._executor._collect_until(self._call, timeout)
        return self._call.future.result(timeout=0)

    def done(self) -> bool:
        return self._call.future.done()


class MultiprocExecutor(Executor):
    def _init_executor(self) -> None:
        pc = self.parallel_config
        self.world_size = pc.world_size
        self._submit_lock = threading.Lock()
        self._collect_lock = threading.Lock()
        self._shutdown_lock = threading.Lock()
        self._call_ids = itertools.count(1)
        self._pending: deque[_PendingCall] = deque()
        self._lookahead: dict[int, RpcReply] = {}
        self._failed_calls: set[int] = set()  # their other ranks' late errors are expected
        self._death: str | None = None
        self._shut_down = False
        self.workers: list[WorkerHandle] = []
        self.reply_queues: list[MessageQueue] = []
        self.monitor: WorkerMonitor | None = None
        self._tmpdir = tempfile.mkdtemp(prefix="shardserve-dist-")
        self.broadcast = MessageQueue(self.world_size, self.world_size, name="rpc-broadcast")
        try:
            self._start(pc.worker_start_timeout_s)
        except BaseException:
            self.shutdown()
            raise

    def _start(self, timeout_s: float) -> None:
        # The file store needs no port, so nothing can take it between choosing and binding.
        init_method = f"file://{self._tmpdir}/store"
        self.workers = start_workers(
            self.config,
            self.broadcast.export_handle(),
            init_method,
            self.parallel_config.worker_cls,
        )
        wait_for_ready(self.workers, timeout_s)
        # Ordering: attach to the reply queues before waiting on the broadcast queue; each
        # worker waits for the broadcast handshake before waiting for our attachment.
        self.reply_queues = [
            MessageQueue.create_from_handle(h.reply_handle, 0, name=f"replies-from-TP{h.rank}")
            for h in self.workers
        ]
        self.broadcast.wait_until_ready(timeout=timeout_s)
        for mq in self.reply_queues:
            mq.wait_until_ready(timeout=timeout_s)
        self.monitor = WorkerMonitor(self.workers, self._on_worker_death)

    # ---- failure ----
    def _on_worker_death(self, handle: WorkerHandle) -> None:
        if self._shut_down:
            return
        self._death = (
            f"worker rank {handle.rank} (pid {handle.pid}) died unexpectedly "
            f"({handle.describe_exit()})"
        )
        logger.error("%s; the engine cannot continue", self._death)
        self.is_failed = True
        callback, self._failure_callback = self._failure_callback, None
        if callback is not None:
            callback()

    def _raise_if_dead(self) -> None:
        if self._death is not None:
            raise EngineDeadError(self._death)
        if self._shut_down:
            raise EngineDeadError("the executor has been shut down")

    # ---- RPC ----
    def collective_rpc(
        self,
        method: str | Callable[..., Any],
        timeout: float | None = None,
        args: tuple = (),
        kwargs: dict[str, Any] | None = None,
        non_block: bool = False,
        unique_reply_rank: int | None = None,
    ) -> Any:
        self._raise_if_dead()
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

    def _send(self, request: RpcRequest, timeout: float | None) -> None:
        try:
            self.broadcast.enqueue(request, timeout=timeout)
        except QueueClosed as e:
            raise EngineDeadError(self._death or f"the broadcast queue closed: {e}") from e

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
            self._raise_if_dead()
            deadline = _earliest(call.deadline, wait_deadline)
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                raise TimeoutError(
                    f"{call.method}() got no reply from worker ranks {missing} within "
                    f"{now - start:.1f} s{self._unusual_workers()} "
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
                    self._death or f"rank {rank}'s reply queue closed: {e}"
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
            dead = self._dead_worker(wait_s=0.5)
            if dead is not None:  # e.g. a collective broken by a peer's death: name the cause
                raise EngineDeadError(self._death or dead) from error
            raise error
        if reply.call_id == call.call_id:
            call.results[rank] = reply.value
        return True  # a stale success reply (of a timed-out call) is dropped

    def _dead_worker(self, wait_s: float) -> str | None:
        """A description of a worker that has exited (waiting up to wait_s for one), or None."""
        sentinels = {h.process.sentinel: h for h in self.workers}
        ready = wait(list(sentinels), timeout=wait_s)
        if not ready:
            return None
        h = sentinels[ready[0]]
        h.process.join(timeout=1)
        return f"worker rank {h.rank} (pid {h.pid}) died unexpectedly ({h.describe_exit()})"

    def _unusual_workers(self) -> str:
        """Workers that are not running or waiting (stopped, zombie...), for timeout messages:
        the rank that blocks a collective is often not the one whose reply is missing."""
        notes = []
        for h in self.workers:
            try:
                status = psutil.Process(h.pid).status()
            except psutil.Error:
                status = "gone"
            if status not in (
                psutil.STATUS_RUNNING,
                psutil.STATUS_SLEEPING,
                psutil.STATUS_DISK_SLEEP,
            ):
                notes.append(f"rank {h.rank} (pid {h.pid}) is {status}")
        return f"; {', '.join(notes)}" if notes else ""

    # ---- shutdown ----
    def shutdown(self) -> None:
        with self._shutdown_lock:  # a concurrent caller waits until the first one is done
            if self._shut_down:
                return
            self._shut_down = True
            if self.monitor is not None:
                self.monitor.stop()
            grace_s = 0.0
            if self.workers and self.monitor is not None:  # running: ask them to exit first
                grace_s = _SHUTDOWN_GRACE_S
                try:
                    self.broadcast.enqueue(RpcRequest(0, SHUTDOWN, (), {}), timeout=1.0)
                except Exception as e:  # a stuck worker's full ring, or closed: signals follow
                    logger.warning("could not ask the workers to exit (%s); stopping them", e)
            stop_workers(self.workers, grace_s)
            for mq in [*self.reply_queues, self.broadcast]:
                mq.close()
            for h in self.workers:  # a killed worker could not unlink its reply ring
                if h.reply_handle is not None and h.reply_handle.shm_name:
                    _unlink_shm(h.reply_handle.shm_name)
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            for call in self._pending:
                if not call.future.done():
                    call.future.set_exception(EngineDeadError("the executor was shut down"))


def _unlink_shm(name: str) -> None:
    try:
        os.unlink(os.path.join("/dev/shm", name.lstrip("/")))
    except FileNotFoundError:
        pass


def _earliest(a: float | None, b: float | None) -> float | None:
    if a is None:
        return b
    return a if b is None else min(a, b)


def _passed(deadline: float | None) -> bool:
    return deadline is not None and time.monotonic() >= deadline
