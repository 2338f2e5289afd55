"""UniProcExecutor: the one worker runs in the caller's process, on a thread of its own.

Every call (start-up included) runs on one thread, in submission order, so `non_block=True`
returns at once and the model computes step N while the engine thread plans step N+1 (torch
releases the GIL inside its kernels). That thread is shared by every in-process worker of the
process: each thread that runs torch kernels gets an OpenMP pool of its own, and once a process
holds more pool threads than cores, libgomp stops spinning between parallel regions and every
small kernel pays a futex wake-up (measured here: two uni engines on two threads decode ~30%
slower than on one). In-process workers share the cores anyway, so one thread loses nothing.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from shardserve.executor.abstract import Executor
from shardserve.idle_threads import QuietThreadPool
from shardserve.worker.build import build_worker
from shardserve.worker.worker import Worker, run_method

_thread: QuietThreadPool | None = None
_thread_lock = threading.Lock()


def worker_thread() -> QuietThreadPool:
    """The process's one thread for in-process workers (started on first use, kept for the
    life of the process; idle, it waits on a queue and costs nothing). Between calls it does
    not keep an mp engine from forking its workers (start_method.py): an engine idle on it,
    or one shut down, holds nothing a child could need."""
    global _thread
    with _thread_lock:
        if _thread is None:
            _thread = QuietThreadPool("shardserve-worker")
        return _thread


def _forget_thread_in_child() -> None:
    """A forked child has no copy of the pool's thread: it starts its own on first use."""
    global _thread, _thread_lock
    _thread, _thread_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_thread_in_child)


class UniProcExecutor(Executor):
    def _init_executor(self) -> None:
        self.worker = self._on_worker_thread(self._build_worker)

    def _build_worker(self) -> Worker:
        """This process's worker (of parallel_config.worker_cls), started: on the worker thread."""
        return build_worker(self.config)

    def _on_worker_thread(self, fn: Callable[[], Any]) -> Any:
        try:
            future = worker_thread().submit(fn)
        except RuntimeError:
            # Interpreter exit: concurrent.futures' exit hook (run before atexit hooks, so
            # before an engine's own) has stopped the pool and joined its thread, so running
            # here cannot race it. An engine left for exit to close gets here.
            return fn()
        return future.result()

    def collective_rpc(
        self,
        method: str | Callable[..., Any],
        timeout: float | None = None,
        args: tuple = (),
        kwargs: dict[str, Any] | None = None,
        non_block: bool = False,
        unique_reply_rank: int | None = None,
    ) -> Any:
        # In-process calls cannot be interrupted, so `timeout` has nothing to bound here.
        self._raise_if_dead()  # after shutdown, or a failure a subclass recorded

        def call() -> Any:
            result = run_method(self.worker, method, args, kwargs or {})
            return result if unique_reply_rank is not None else [result]

        future: Future = worker_thread().submit(call)
        return future if non_block else future.result()

    def _shutdown(self) -> None:  # Executor.shutdown: once, under its lock
        self._on_worker_thread(self.worker.shutdown)
