"""MessageQueueReader: one reader rank, attached from the writer's handle, dequeuing in order.

message_queue.py has the overview; shm_ring.py the ring's layout and flag protocol.
"""

from __future__ import annotations

import os
import time
from typing import Any, Self

from shardserve.ipc import serialization as ser
from shardserve.ipc import wakeup
from shardserve.ipc.errors import PeerGone, QueueClosed
from shardserve.ipc.message_queue import Handle, MessageQueue, deadline_of
from shardserve.ipc.shm_ring import RingLayout, ShmRing
from shardserve.ipc.waiting import BoundedWait
from shardserve.ipc.zmq_channel import KIND_CLOSE, KIND_MSG, KIND_READY, Subscriber

_yield = os.sched_yield
_POLL_SKIP_FACTOR = 4
# A remote reader gives up on a writer whose connection has been down this long (a dead
# process's connection closes at once; a vanished host's after the heartbeat timeout).
_REMOTE_WRITER_GRACE_S = 5.0
_OVERFLOW = object()


class MessageQueueReader(MessageQueue):
    """Reader ``rank`` (0..n_reader-1) of the queue ``handle`` describes: ranks below
    ``n_local_reader`` read the shared-memory ring (and the ``ipc://`` overflow socket), the
    others every message over ``tcp://``."""

    def __init__(self, handle: Handle, rank: int, *, name: str | None = None,
                 spin_us: float | None = None, warn_interval_s: float | None = None,
                 recheck_ms: float | None = None) -> None:
        if not 0 <= rank < handle.n_reader:
            raise ValueError(f"rank {rank} is not in 0..{handle.n_reader - 1}")
        super().__init__(name or handle.name, handle.n_reader, handle.n_local_reader,
                         handle.max_chunk_bytes, handle.max_chunks, spin_us,
                         handle.recheck_s * 1000 if recheck_ms is None else recheck_ms,
                         handle.warn_interval_s if warn_interval_s is None else warn_interval_s,
                         sleep_slot=rank)
        self.rank, self.handle = rank, handle
        self._sub: Subscriber | None = None
        self._pending_overflow = False  # the ring held an overflow marker: the socket has it
        self._last_msg_t = time.monotonic()
        self._last_wait_s = 0.0  # how long the last wait for a message took (poll or not)
        local = rank < handle.n_local_reader
        self._writer_addr = handle.local_addr if local else handle.remote_addr
        try:
            if local:
                self._ring = _attach_ring(handle, rank)
            assert self._writer_addr is not None
            self._sub = Subscriber(self._writer_addr, rank, None if local else handle.curve)
        except BaseException:
            self._release()
            raise

    @classmethod
    def from_handle(cls, handle: Handle, rank: int, **options: Any) -> Self:
        """The constructor, named as at most call sites: ``options`` are its keywords."""
        return cls(handle, rank, **options)

    def _role(self) -> str:
        return f"reader rank {self.rank}"

    def _handshake(self, deadline: float | None) -> None:
        while True:
            frames = self._recv_frames(deadline, "the writer's READY")
            if bytes(frames[0]) == KIND_READY:
                return

    # ---- reading ---------------------------------------------------------------------------
    def dequeue(self, timeout: float | None = None) -> Any:
        """Next message, in order. ``TimeoutError`` after ``timeout`` s, ``QueueClosed`` when
        this end or the writer is closed (or the writer process is gone)."""
        with self._op_lock:
            self._raise_if_closing()
            deadline = deadline_of(timeout)
            if self._ring is None or self._pending_overflow:
                obj = self._recv_message(deadline)
            else:
                obj = self._read_ring(deadline)
            self._last_msg_t = time.monotonic()
            return obj

    def _read_ring(self, deadline: float | None) -> Any:
        ring, n = self._ring, self._next
        if not ring.is_written(n):
            self._wait_written(n, deadline)
        chunk = ring.chunks[ring.chunk_of(n)]
        try:
            if ser.frame_kind(chunk) == ser.OVERFLOW:
                self._pending_overflow = True
                obj = _OVERFLOW
            else:
                obj = ser.read_inline(chunk)
        finally:  # release even when decoding raised: the writer must never wait on us forever
            self._next = n + 1
            ring.release(n, self.rank)
        # The socket carries only overflowed messages, in order: the next one there is this one.
        return self._recv_message(deadline) if obj is _OVERFLOW else obj

    def _wait_written(self, n: int, deadline: float | None) -> None:
        ring = self._ring
        idx = ring.written_index(ring.chunk_of(n))
        words, want, addr = ring.words, n & 0xFFFF_FFFF, ring.addr(idx)
        start = time.perf_counter()
        try:
            if self._poll(words, idx, want, start):
                return
            self._block_until_written(n, deadline, idx, want, addr)
        finally:
            self._last_wait_s = time.perf_counter() - start

    def _poll(self, words: memoryview, idx: int, want: int, start: float) -> bool:
        """Look at the word, yielding the core between looks, for up to the poll window. Skipped
        when the last wait took several windows (a slow peer, e.g. a model step: sleeping costs
        nothing then and the wake-up is small beside the wait); cut short when the writer says
        it is copying a big message in (see shm_ring.py)."""
        if self._last_wait_s > _POLL_SKIP_FACTOR * self._spin_s:
            return False
        end, ring = start + self._spin_s, self._ring
        while True:
            if words[idx] == want:
                return True
            if time.perf_counter() >= end or ring.writer_copying(want):
                return False
            _yield()

    def _block_until_written(self, n: int, deadline: float | None, idx: int, want: int,
                             addr: int) -> None:
        ring, words = self._ring, self._ring.words
        wait = BoundedWait(self, deadline, lambda: self._describe_writer(n),
                           self._check_writer_alive)
        while (seen := words[idx]) != want:
            if ring.writer_info()[2]:  # writer closed: deliver what it wrote, then stop
                if words[idx] == want:
                    return
                raise QueueClosed(f"{self._who()}: the writer closed the queue")
            self._sleep(addr, seen, wait.tick())

    def _describe_writer(self, n: int) -> str:
        pid = self._ring.writer_info()[0] if self._ring else "?"
        idle = time.monotonic() - self._last_msg_t
        return (f"the writer (pid {pid}) has written nothing for {idle:.1f} s "
                f"(waiting for message {n})")

    def _check_writer_alive(self) -> None:
        if self._ring is None:  # a remote reader: is the connection to the writer up?
            gone = self._sub.writer_gone_for() if self._sub is not None else 0.0
            if gone > _REMOTE_WRITER_GRACE_S:
                raise PeerGone(f"{self._who()}: the writer at {self._writer_addr} has been "
                               f"unreachable for {gone:.1f} s (its process exited, or the "
                               f"network between us is down)")
            return
        pid, start, closed = self._ring.writer_info()
        if not closed and not wakeup.process_alive(pid, start):
            raise PeerGone(f"{self._who()}: the writer (pid {pid}) is gone "
                           f"(process exited or was killed)")

    def _recv_message(self, deadline: float | None) -> Any:
        while True:
            frames = self._recv_frames(deadline, "the next message over ZMQ")
            kind = bytes(frames[0])
            if kind == KIND_MSG:
                self._pending_overflow = False
                return ser.decode_frames(frames[1:])
            # KIND_READY: the handshake, when wait_until_ready was not called; skip it

    def _recv_frames(self, deadline: float | None, what: str) -> list[Any]:
        sub = self._sub
        frames = sub.try_recv()
        if frames is None:
            wait = BoundedWait(self, deadline, lambda: f"nothing received while waiting for {what}",
                               self._check_writer_alive)
            while (frames := sub.try_recv()) is None:
                sub.wait(wait.tick())
        if bytes(frames[0]) == KIND_CLOSE:
            raise QueueClosed(f"{self._who()}: the writer closed the queue")
        return frames

    # ---- closing -----------------------------------------------------------------------------
    def _close_ends(self) -> None:
        if self._ring is not None:
            self._ring.mark_reader_closed(self.rank)  # a writer waiting on our release stops
        if self._sub is not None:
            self._sub.close()


def _attach_ring(handle: Handle, rank: int) -> ShmRing:
    """Map the writer's ring and put this process's pid in reader ``rank``'s header record."""
    assert handle.shm_name is not None and handle.local_addr is not None
    layout = RingLayout(handle.n_local_reader, handle.max_chunk_bytes, handle.max_chunks)
    ring = ShmRing(layout, handle.shm_name, create=False)
    ring.register_reader(rank)
    return ring
