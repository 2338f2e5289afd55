"""UniProcExecutor: the one worker runs in the caller's process.

Without asynchronous scheduling, calls are direct. With it, every call (start-up included) runs
on one thread of the executor's own, in submission order, so `non_block=True` returns at once and
the model computes step N while the engine thread plans step N+1 (torch releases the GIL inside
its kernels). One thread for everything also keeps every OpenMP-parallel kernel on one thread's
OpenMP pool.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from shardserve.executor.abstract import Executor
from shardserve.worker.worker import Worker, run_method


class UniProcExecutor(Executor):
    def _init_executor(self) -> None:
        self._thread: ThreadPoolExecutor | None = None
        if self.config.scheduler_config.async_scheduling:
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="shardserve-worker")
        try:
            self.worker = self._on_worker_thread(self._start_worker)
        except BaseException:
            self._stop_thread()
            raise

    def _start_worker(self) -> Worker:
        worker = self._make_worker()
        worker.init_device()
        worker.load_model()
        return worker

    def _make_worker(self) -> Worker:
        return Worker(self.config, rank=0, local_rank=0)

    def _on_worker_thread(self, fn: Callable[[], Any]) -> Any:
        return fn() if self._thread is None else self._thread.submit(fn).result()

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

        if self._thread is not None:
            future = self._thread.submit(call)
            return future if non_block else future.result()
        if not non_block:
            return call()
        done: Future = Future()
        try:
            done.set_result(call())
        except BaseException as e:
            done.set_exception(e)
        return done

    def shutdown(self) -> None:
        if not self._shut_down:
            self._shut_down = True
            try:
                self._on_worker_thread(self.worker.shutdown)
            finally:
                self._stop_thread()

    def _stop_thread(self) -> None:
        if self._thread is not None:
            self._thread.shutdown(wait=True)
