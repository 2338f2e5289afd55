"""Threads whose owner can tell when they hold nothing a forked child could need.

The engine forks its child processes only while no other Python thread runs (a lock one of
them holds would stay locked for ever in the child: executor/start_method.py). Some threads of
ours live on between uses and then only block on a queue or poll of their own, which a child
never touches: such a thread is registered here with a check, and does not count while the
check holds. Threads of unknown owners always count.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

_idle_checks: dict[threading.Thread, Callable[[], bool]] = {}


def count_as_idle(thread: threading.Thread, idle: Callable[[], bool]) -> None:
    """Let `thread` not stand in fork's way while `idle()` holds."""
    for ended in [t for t in _idle_checks if not t.is_alive()]:
        del _idle_checks[ended]
    _idle_checks[thread] = idle


def is_idle(thread: threading.Thread) -> bool:
    check = _idle_checks.get(thread)
    return check is not None and check()


class QuietThreadPool:
    """One background thread for calls (a ThreadPoolExecutor of one) that does not stand in
    fork's way while it has no call queued or running: it then only waits on its queue. A
    forked child has no copy of the thread (make a new pool there)."""

    def __init__(self, name: str) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=name)
        self._lock = threading.Lock()
        self.pending = 0  # calls submitted and not finished
        count_as_idle(self._pool.submit(threading.current_thread).result(),
                      lambda: self.pending == 0)

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        """Run `fn(*args)` on the thread; RuntimeError once shut down (or at interpreter exit)."""
        with self._lock:
            self.pending += 1
        try:
            future = self._pool.submit(fn, *args)
        except BaseException:
            self._done(None)
            raise
        future.add_done_callback(self._done)  # runs on the thread, just after fn returns
        return future

    def _done(self, _: Future | None) -> None:
        with self._lock:
            self.pending -= 1

    def shutdown(self, wait: bool = True, cancel_futures: bool = False) -> None:
        self._pool.shutdown(wait=wait, cancel_futures=cancel_futures)
