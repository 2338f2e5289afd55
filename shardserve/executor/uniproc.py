"""UniProcExecutor: the one worker runs in the caller's process; calls are direct."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from shardserve.executor.abstract import Executor
from shardserve.worker.worker import Worker, run_method


class UniProcExecutor(Executor):
    def _init_executor(self) -> None:
        self.worker = Worker(self.config, rank=0, local_rank=0)
        self.worker.init_device()
        self.worker.load_model()

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
        future: Future = Future()
        try:
            result = run_method(self.worker, method, args, kwargs or {})
            future.set_result(result if unique_reply_rank is not None else [result])
        except BaseException as e:
            if not non_block:
                raise
            future.set_exception(e)
        return future if non_block else future.result()

    def shutdown(self) -> None:
        if not self._shut_down:
            self._shut_down = True
            self.worker.shutdown()
