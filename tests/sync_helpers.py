"""Putting a test's processes and threads into a known state, instead of sleeping and hoping.

A sleep ("give it 0.5 s to get into generate") encodes a guess about this machine's speed: on a
loaded 2-core machine it guesses wrong. These helpers wait for states the code exposes:

- `frozen(pid)`: SIGSTOP a process and wait until the kernel says it is stopped. A frozen engine
  makes no progress, so a request it serves provably cannot finish while the test acts.
- `PipeText`: a child's output read without a thread, so "everything it wrote so far" is well
  defined (a frozen child has written all it will until it continues).
- `in_call(thread, code)`: a thread is inside a given function right now.
- `wait_until(predicate)`: the one polling loop, always bounded, naming what it waited for.

Deadlines here are only there to turn a hang into a failure: generous, never a speed claim.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from types import CodeType
from typing import IO

import psutil

HANG_S = 60.0  # "this will never happen": far beyond any legitimate wait on a loaded machine


def wait_until(predicate: Callable[[], object], what: str, timeout_s: float = HANG_S,
               interval_s: float = 0.01) -> None:
    """Poll `predicate` until it is true; AssertionError naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s:.0f} s: {what}")
        time.sleep(interval_s)


def is_stopped(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() in (psutil.STATUS_STOPPED,
                                                psutil.STATUS_TRACING_STOP)
    except psutil.NoSuchProcess:
        return False


@contextlib.contextmanager
def frozen(pid: int) -> Iterator[None]:
    """SIGSTOP `pid` until the block ends (then SIGCONT, if it still exists).

    Signals sent to it meanwhile (other than SIGKILL) stay pending and are delivered when it
    continues, which is how a test places a signal at a known point of the child's work.
    """
    os.kill(pid, signal.SIGSTOP)
    try:
        wait_until(lambda: is_stopped(pid) or not psutil.pid_exists(pid),
                   f"pid {pid} to stop after SIGSTOP")
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


def in_call(thread: threading.Thread, code: CodeType) -> bool:
    """Whether `thread` is, right now, executing the function whose code object is `code`
    (anywhere on its stack)."""
    frame = sys._current_frames().get(thread.ident)
    while frame is not None:
        if frame.f_code is code:
            return True
        frame = frame.f_back
    return False


class PipeText:
    """What a child wrote to one pipe (its stderr, say), read by the test's own thread."""

    def __init__(self, pipe: IO) -> None:
        self._pipe = pipe  # kept: closing the file object would close the fd under us
        self._fd = pipe.fileno()
        os.set_blocking(self._fd, False)
        self._data = bytearray()
        self.eof = False

    @property
    def text(self) -> str:
        return self._data.decode(errors="replace")

    def _read_ready(self, timeout_s: float) -> None:
        if self.eof or not select.select([self._fd], [], [], max(0.0, timeout_s))[0]:
            return
        while True:
            try:
                chunk = os.read(self._fd, 1 << 16)
            except BlockingIOError:
                return
            if not chunk:
                self.eof = True
                return
            self._data += chunk

    def read_until(self, predicate: Callable[[str], bool], what: str,
                   timeout_s: float = HANG_S) -> None:
        deadline = time.monotonic() + timeout_s
        while not predicate(self.text):
            if self.eof or time.monotonic() > deadline:
                raise AssertionError(f"no {what} within {timeout_s:.0f} s (eof={self.eof}):\n"
                                     f"{self.text[-3000:]}")
            self._read_ready(min(0.5, deadline - time.monotonic()))

    def drain(self) -> None:
        """Everything written so far: with the writers frozen, nothing more can arrive."""
        self._read_ready(0)

    def read_to_eof(self, timeout_s: float = HANG_S) -> None:
        """Until every writer has closed the pipe (they exited)."""
        self.read_until(lambda _: self.eof, "end of output", timeout_s)
