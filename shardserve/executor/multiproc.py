"""MultiprocExecutor: one worker process per rank, fed by the shared-memory broadcast queue.

    collective_rpc ──RpcRequest──▶ broadcast MessageQueue (1 → world_size) ──▶ rank busy loops
    RpcChannel    ◀──RpcReply──── one reply MessageQueue per rank ◀────────────────┘

The call/reply bookkeeping (ordering, errors from any rank, stale replies) lives in
rpc_channel.py, shared with ray_v2; this class supplies the processes and their death watch.
Process start-up, death watch and staged stop live in worker_process.py.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
from collections.abc import Callable
from multiprocessing.connection import wait
from typing import Any

import psutil

from shardserve.errors import EngineDeadError
from shardserve.executor.abstract import Executor
from shardserve.executor.rpc_channel import RpcChannel, WorkerHooks
from shardserve.executor.worker_process import (
    WorkerHandle,
    WorkerMonitor,
    start_workers,
    stop_workers,
    wait_for_ready,
)
from shardserve.ipc import MessageQueue
from shardserve.ipc.rpc import SHUTDOWN, RpcRequest

logger = logging.getLogger(__name__)

_SHUTDOWN_GRACE_S = 2.0


class MultiprocExecutor(Executor):
    def _init_executor(self) -> None:
        pc = self.parallel_config
        self.world_size = pc.world_size
        self._shutdown_lock = threading.Lock()
        self.channel: RpcChannel | None = None
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
        self.channel = RpcChannel(
            self.broadcast,
            self.reply_queues,
            WorkerHooks(
                self._raise_if_dead, lambda: self._death, self._dead_worker, self._unusual_workers
            ),
        )
        self.monitor = WorkerMonitor(self.workers, self._on_worker_death)

    # ---- failure ----
    def _on_worker_death(self, handle: WorkerHandle) -> None:
        self._mark_failed(
            f"worker rank {handle.rank} (pid {handle.pid}) died unexpectedly "
            f"({handle.describe_exit()})"
        )

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
        assert self.channel is not None
        return self.channel.call(method, timeout, args, kwargs, non_block, unique_reply_rank)

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
            if self.channel is not None:
                self.channel.fail_pending(EngineDeadError("the executor was shut down"))


def _unlink_shm(name: str) -> None:
    try:
        os.unlink(os.path.join("/dev/shm", name.lstrip("/")))
    except FileNotFoundError:
        pass
