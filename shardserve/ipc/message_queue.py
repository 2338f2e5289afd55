"""MessageQueue: one writer broadcasts picklable objects to n readers, in order, exactly once.

The two ends are two types over the base class here (what both need: the ring, the handle,
readiness, close)::

    MessageQueueWriter(n_reader, n_local_reader, ...)      message_queue_writer.py
        .export_handle() ──Handle (pickled to each reader's process)──┐
        .enqueue(obj)                                                 ▼
                                      MessageQueueReader.from_handle(handle, rank)
                                          .dequeue()                  message_queue_reader.py

Local readers (ranks ``0 .. n_local_reader-1``, same host) read from a shared-memory ring
(shm_ring.py); a waiting side polls its ring word briefly, yielding the core between looks, then
sleeps on it with a futex (wakeup.py explains the choice); messages larger than a chunk go over
a ZMQ ``ipc://`` socket with a marker in the ring. Remote readers (the other ranks) get every
message over ZMQ ``tcp://`` (zmq_channel.py). Every wait is bounded, names whom it waits for,
and ends with ``QueueClosed`` within a second when this end is closed (from any thread) or the
other side goes away. See shm_ring.py for the layout and the flag protocol.
"""

from __future__ import annotations

import abc
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Self

from shardserve import envs
from shardserve.ipc import wakeup
from shardserve.ipc.curve_auth import CurveKeys
from shardserve.ipc.errors import QueueClosed
from shardserve.ipc.shm_ring import ShmRing

logger = logging.getLogger(__name__)

_CLOSE_WAIT_S = 2.0  # how long close() waits for an operation in another thread to unwind


@dataclass(frozen=True)
class Handle:
    """Everything a reader process needs to attach; picklable."""

    n_reader: int
    n_local_reader: int
    max_chunk_bytes: int
    max_chunks: int
    shm_name: str | None
    local_addr: str | None
    remote_addr: str | None
    writer_pid: int
    name: str
    recheck_s: float
    warn_interval_s: float
    curve: CurveKeys | None = None  # a remote reader's keys (ipc/curve_auth.py); no secret


class MessageQueue(abc.ABC):
    """One end of a broadcast queue: ``MessageQueueWriter`` or ``MessageQueueReader``.

    Every public operation holds ``_op_lock`` for its whole length, so one end is used by one
    thread at a time; only ``close()`` may come from another thread while an operation waits
    (it sets ``_closing``, wakes the futex the waiter sleeps on, and releases the end once the
    waiter has unwound)."""

    handle: Handle  # the writer's own (made once its sockets are bound), or a reader's origin
    _ring: ShmRing | None  # None where this end has no local reader (a remote reader's, too)

    def __init__(self, name: str, n_reader: int, n_local_reader: int, max_chunk_bytes: int,
                 max_chunks: int, spin_us: float | None, recheck_ms: float | None,
                 warn_interval_s: float | None, sleep_slot: int | None) -> None:
        self.name = name
        self.n_reader, self.n_local_reader = n_reader, n_local_reader
        self.max_chunk_bytes, self.max_chunks = max_chunk_bytes, max_chunks
        self.recheck_s = (envs.ipc_recheck_ms() if recheck_ms is None else recheck_ms) / 1000
        self.warn_interval_s = (envs.ipc_warn_interval_s() if warn_interval_s is None
                                else warn_interval_s)
        self._spin_s = wakeup.poll_window_s(envs.ipc_spin_us() if spin_us is None else spin_us)
        self._sleep_slot = sleep_slot  # whose sleeping word in the ring header (None: writer)
        self._ring = None
        self._next = 1  # number of the next message this end writes or reads (shm_ring.py)
        self._ready = False
        self._closing = False
        self._released = False
        self._op_lock = threading.Lock()
        self._wait_addr = 0  # futex word this process is sleeping on (close() wakes it)

    # ---- what each end adds ------------------------------------------------------------------
    @abc.abstractmethod
    def _role(self) -> str:
        """This end in log and error messages: "writer", "reader rank 2"."""

    @abc.abstractmethod
    def _handshake(self, deadline: float | None) -> None:
        """Wait (bounded) until the other side is ready; called once, under ``_op_lock``."""

    @abc.abstractmethod
    def _close_ends(self) -> None:
        """Mark this end closed in the ring and close its sockets; the ring is closed after."""

    # ---- naming ----------------------------------------------------------------------------
    def _who(self) -> str:
        return f"MessageQueue {self.name!r} {self._role()} (pid {os.getpid()})"

    # ---- readiness -------------------------------------------------------------------------
    def wait_until_ready(self, timeout: float | None = None) -> None:
        """Writer: wait until every reader is connected. Reader: until the writer says so."""
        with self._op_lock:
            self._raise_if_closing()
            self._wait_ready_locked(deadline_of(timeout))

    def _wait_ready_locked(self, deadline: float | None) -> None:
        if not self._ready:
            self._handshake(deadline)
            self._ready = True

    # ---- waiting -----------------------------------------------------------------------------
    def _sleep(self, addr: int, seen: int, timeout_s: float) -> None:
        """Sleep on a ring word; announced, so the other side knows to send a wake-up."""
        self._wait_addr = addr
        ring = self._ring
        ring.set_sleeping(self._sleep_slot, True)
        try:
            wakeup.futex_wait(addr, seen, timeout_s)
        finally:
            ring.set_sleeping(self._sleep_slot, False)
            self._wait_addr = 0

    def is_sleeping(self, rank: int | None = None) -> bool:
        """Whether local reader `rank` (None: the writer) is blocked in a wait on the ring right
        now, as its ring header announces (read-only; for tests and diagnostics). Any side with
        the ring mapped may ask; remote readers wait on ZMQ and have no such word."""
        if self._ring is None or (rank is not None and not 0 <= rank < self.n_local_reader):
            raise ValueError(f"{self._who()}: rank {rank} has no sleeping word on this ring")
        return self._ring.is_sleeping(rank)

    # ---- closing -----------------------------------------------------------------------------
    def _raise_if_closing(self) -> None:
        if self._closing:
            raise QueueClosed(f"{self._who()}: the queue was closed")

    def close(self) -> None:
        """Idempotent. Blocked calls in other threads (and peers) get QueueClosed promptly."""
        if self._closing:
            return
        self._closing = True
        if self._wait_addr:
            wakeup.futex_wake(self._wait_addr)
        if self._op_lock.acquire(timeout=_CLOSE_WAIT_S):
            try:
                self._release()
            finally:
                self._op_lock.release()
        else:  # an operation is stuck in user code (e.g. unpickling); it cannot touch us again
            logger.warning("%s: close() could not wait for a running operation; the shared "
                           "memory mapping is left to the garbage collector", self._who())

    def _release(self) -> None:
        """Also the clean-up of a constructor that failed half-way: every resource may be None."""
        if self._released:
            return
        self._released = True
        self._close_ends()  # first: the closed mark must reach peers while the ring is mapped
        if self._ring is not None:
            self._ring.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __reduce__(self) -> Any:
        raise TypeError(f"a {type(self).__name__} cannot be pickled; send the writer's "
                        f"export_handle() instead")


def deadline_of(timeout: float | None) -> float | None:
    """The monotonic time a wait of ``timeout`` s (None: unbounded) ends at."""
    return None if timeout is None else time.monotonic() + max(0.0, timeout)
