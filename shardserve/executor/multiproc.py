"""MultiprocExecutor: one worker process per rank, fed by the shared-memory broadcast queue.

    collective_rpc ──RpcRequest──▶ broadcast MessageQueue (1 → world_size) ──▶ rank busy loops
    RpcChannel    ◀──RpcReply──── one reply MessageQueue per rank ◀────────────────┘

The queues and the call/reply bookkeeping live in queue_rpc.py / rpc_channel.py, shared with
ray_v2; this class supplies the processes and their death watch (worker_process.py: start-up,
death watch, staged stop).
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import threading
from multiprocessing.connection import wait
from typing import Any

import psutil

from shardserve.executor.abstract import Executor
from shardserve.executor.queue_rpc import QueueRpc
from shardserve.executor.rpc_channel import WorkerHooks
from shardserve.executor.worker_process import (
    WorkerHandle,
    WorkerMonitor,
    start_workers,
    stop_workers,
    wait_for_ready,
)
from shardserve.ipc import MessageQueue
from shardserve.ipc.segments import unlink_segments_of

logger = logging.getLogger(__name__)

_SHUTDOWN_GRACE_S = 2.0


class MultiprocExecutor(Executor):
    supports_pp = True

    def _init_executor(self) -> None:
        pc = self.parallel_config
        self.world_size = pc.world_size
        self._shutdown_lock = threading.Lock()
        self.workers: list[WorkerHandle] = []
        self.monitor: WorkerMonitor | None = None
        self._tmpdir = tempfile.mkdtemp(prefix="shardserve-dist-")
        self.rpc = QueueRpc(MessageQueue(self.world_size, self.world_size, name="rpc-broadcast"))
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
            self.rpc.broadcast.export_handle(),
            init_method,
            self.parallel_config.worker_cls,
        )
        wait_for_ready(self.workers, timeout_s)
        hooks = WorkerHooks(
            self._raise_if_dead, lambda: self._death, self._dead_worker, self._unusual_workers
        )
        self.rpc.connect([h.reply_handle for h in self.workers], hooks, timeout_s)
        self.monitor = WorkerMonitor(self.workers, self._on_worker_death)

    # ---- failure ----
    def _on_worker_death(self, handle: WorkerHandle) -> None:
        self._mark_failed(
            f"worker {self.parallel_config.describe_rank(handle.rank, f'pid {handle.pid}')} "
            f"died unexpectedly ({handle.describe_exit()})"
        )

    def collective_rpc(self, *args: Any, **kwargs: Any) -> Any:  # see Executor
        self._raise_if_dead()
        return self.rpc.call(*args, **kwargs)

    def _dead_worker(self, wait_s: float) -> str | None:
        """A description of a worker that has exited (waiting up to wait_s for one), or None."""
        sentinels = {h.process.sentinel: h for h in self.workers}
        ready = wait(list(sentinels), timeout=wait_s)
        if not ready:
            return None
        h = sentinels[ready[0]]
        h.process.join(timeout=1)
        who = self.parallel_config.describe_rank(h.rank, f"pid {h.pid}")
        return f"worker {who} died unexpectedly ({h.describe_exit()})"

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
            running = bool(self.workers) and self.monitor is not None
            asked = running and self.rpc.ask_workers_to_exit()
            stop_workers(self.workers, _SHUTDOWN_GRACE_S if asked else 0.0)
            self.rpc.close()
            for h in self.workers:  # what a killed worker could not unlink (e.g. all-reduce)
                if not h.process.is_alive():
                    unlink_segments_of(h.pid)
            shutil.rmtree(self._tmpdir, ignore_errors=True)
