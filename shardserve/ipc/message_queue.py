"""MessageQueue: one writer broadcasts picklable objects to n readers, in order, exactly once.

Local readers (ranks ``0 .. n_local_reader-1``, same host) read from a shared-memory ring
(shm_ring.py); a waiting side polls its ring word briefly, yielding the core between looks, then
sleeps on it with a futex (wakeup.py explains the choice); messages larger than a chunk go over
a ZMQ ``ipc://`` socket with a marker in the ring. Remote readers (the other ranks) get every
message over ZMQ ``tcp://``. Every wait is bounded, names whom it waits for, and ends with
``QueueClosed`` within a second when this queue is closed (from any thread) or the other side
goes away. See shm_ring.py for the layout and the flag protocol.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from shardserve import envs
from shardserve.ipc import serialization as ser
from shardserve.ipc import wakeup
from shardserve.ipc.curve_auth import CurveKeys
from shardserve.ipc.errors import PeerGone, QueueClosed
from shardserve.ipc.shm_ring import RingLayout, ShmRing
from shardserve.ipc.waiting import BoundedWait
from shardserve.ipc.zmq_channel import KIND_CLOSE, KIND_MSG, KIND_READY, Publisher, Subscriber

logger = logging.getLogger(__name__)
_yield = os.sched_yield
_POLL_SKIP_FACTOR = 4

_CLOSE_WAIT_S = 2.0  # how long close() waits for an operation in another thread to unwind
# A remote reader gives up on a writer whose connection has been down this long (a dead
# process's connection closes at once; a vanished host's after the heartbeat timeout).
_REMOTE_WRITER_GRACE_S = 5.0
_OVERFLOW = object()


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


class MessageQueue:
    """Broadcast queue; the constructor makes the writer, ``create_from_handle`` a reader."""

    def __init__(self, n_reader: int, n_local_reader: int, max_chunk_bytes: int = 1 << 24,
                 max_chunks: int = 10, connect_ip: str | None = None, *,
                 name: str | None = None, spin_us: float | None = None,
                 recheck_ms: float | None = None, warn_interval_s: float | None = None,
                 notify: bool | None = None) -> None:
        if not 0 <= n_local_reader <= n_reader or n_reader < 1:
            raise ValueError(f"need 0 <= n_local_reader ({n_local_reader}) <= n_reader "
                             f"({n_reader}) and n_reader >= 1")
        if max_chunk_bytes < 64 or max_chunks < 1:
            raise ValueError("max_chunk_bytes must be >= 64 and max_chunks >= 1")
        self._init_common(name or f"mq-{secrets.token_hex(3)}", None, n_reader, n_local_reader,
                          max_chunk_bytes, max_chunks, spin_us, recheck_ms, warn_interval_s)
        self._notify = not envs.ipc_drop_notify() if notify is None else notify
        self._next = 1
        self._local_pub = self._remote_pub = None
        self._ring = ShmRing.create(n_local_reader, max_chunk_bytes, max_chunks) \
            if n_local_reader else None
        try:
            if n_local_reader:
                self._local_pub = Publisher("ipc", name=self.name, n_reader=n_local_reader)
            if n_reader > n_local_reader:
                self._remote_pub = Publisher("tcp", connect_ip or envs.host_ip() or _host_ip(),
                                             name=self.name, n_reader=n_reader)
        except BaseException:
            self._release()
            raise

    def _init_common(self, name: str, rank: int | None, n_reader: int, n_local: int,
                     chunk: int, chunks: int, spin_us: float | None, recheck_ms: float | None,
                     warn_interval_s: float | None) -> None:
        self.name, self.rank = name, rank
        self.n_reader, self.n_local_reader = n_reader, n_local
        self.max_chunk_bytes, self.max_chunks = chunk, chunks
        self.recheck_s = (envs.ipc_recheck_ms() if recheck_ms is None else recheck_ms) / 1000
        self.warn_interval_s = (envs.ipc_warn_interval_s() if warn_interval_s is None
                                else warn_interval_s)
        spin = envs.ipc_spin_us() if spin_us is None else spin_us
        self._spin_s = wakeup.poll_window_s(spin)
        self._encoder = ser.Encoder(envs.ipc_oob_threshold())
        self._ready = False
        self._closing = False
        self._released = False
        self._op_lock = threading.Lock()
        self._wait_addr = 0  # futex word this process is sleeping on (close() wakes it)
        self._pending_overflow = False
        self._last_msg_t = time.monotonic()
        self._last_wait_s = 0.0  # how long the last wait for a message took (poll or not)

    @property
    def is_writer(self) -> bool:
        return self.rank is None

    def export_handle(self) -> Handle:
        return Handle(self.n_reader, self.n_local_reader, self.max_chunk_bytes, self.max_chunks,
                      self._ring.name if self._ring else None,
                      self._local_pub.addr if self._local_pub else None,
                      self._remote_pub.addr if self._remote_pub else None,
                      os.getpid(), self.name, self.recheck_s, self.warn_interval_s,
                      self._remote_pub.keys.for_reader()
                      if self._remote_pub and self._remote_pub.keys else None)

    @classmethod
    def create_from_handle(cls, handle: Handle, rank: int, *, name: str | None = None,
                           spin_us: float | None = None, warn_interval_s: float | None = None,
                           recheck_ms: float | None = None) -> MessageQueue:
        """Attach reader ``rank`` (0..n_reader-1); ranks below n_local_reader are local."""
        if not 0 <= rank < handle.n_reader:
            raise ValueError(f"rank {rank} is not in 0..{handle.n_reader - 1}")
        self = cls.__new__(cls)
        self._init_common(name or handle.name, rank, handle.n_reader, handle.n_local_reader,
                          handle.max_chunk_bytes, handle.max_chunks, spin_us,
                          handle.recheck_s * 1000 if recheck_ms is None else recheck_ms,
                          handle.warn_interval_s if warn_interval_s is None else warn_interval_s)
        self._notify = not envs.ipc_drop_notify()
        self._next = 1
        self._local_pub = self._remote_pub = None
        self._ring, self._sub = None, None
        local = rank < handle.n_local_reader
        try:
            if local:
                assert handle.shm_name is not None and handle.local_addr is not None
                layout = RingLayout(handle.n_local_reader, handle.max_chunk_bytes,
                                    handle.max_chunks)
                self._ring = ShmRing(layout, handle.shm_name, create=False)
                self._ring.register_reader(rank)
            addr = handle.local_addr if local else handle.remote_addr
            assert addr is not None
            self._remote_addr = addr
            self._sub = Subscriber(addr, rank, None if local else handle.curve)
        except BaseException:
            self._release()
            raise
        return self

    # ---- naming ----------------------------------------------------------------------------
    def _who(self) -> str:
        role = "writer" if self.is_writer else f"reader rank {self.rank}"
        return f"MessageQueue {self.name!r} {role} (pid {os.getpid()})"

    def _reader_desc(self, r: int) -> str:
        if r >= self.n_local_reader:
            return f"rank {r} (remote)"
        pid = self._ring.reader_info(r)[0] if self._ring else 0
        return f"rank {r} (pid {pid})" if pid else f"rank {r} (not attached yet)"

    # ---- readiness -------------------------------------------------------------------------
    def wait_until_ready(self, timeout: float | None = None) -> None:
        """Writer: wait until every reader is connected. Reader: until the writer says so."""
        with self._op_lock:
            self._raise_if_closing()
            self._wait_ready_locked(_deadline(timeout))

    def _wait_ready_locked(self, deadline: float | None) -> None:
        if self._ready:
            return
        if self.is_writer:
            self._writer_handshake(deadline)
        else:
            while True:
                frames = self._recv_frames(deadline, "the writer's READY")
                if bytes(frames[0]) == KIND_READY:
                    break
        self._ready = True

    def _missing_readers(self) -> list[int]:
        missing = []
        for r in range(self.n_reader):
            pub = self._local_pub if r < self.n_local_reader else self._remote_pub
            attached = r >= self.n_local_reader or self._ring.reader_info(r)[0] != 0
            if not attached or r not in pub.connected:
                missing.append(r)
        return missing

    def _writer_handshake(self, deadline: float | None) -> None:
        def describe() -> str:
            names = ", ".join(self._reader_desc(r) for r in self._missing_readers())
            return f"readers not connected yet: {names}"

        wait = BoundedWait(self, deadline, describe, lambda: None)
        while self._missing_readers():
            pubs = [p for p in (self._local_pub, self._remote_pub) if p is not None]
            slice_s = wait.tick() / len(pubs)
            for pub in pubs:
                pub.poll_hellos(slice_s)
        for pub in (self._local_pub, self._remote_pub):
            if pub is not None:
                pub.send(KIND_READY, [], wait.tick)
        if self._ring is not None:
            self._ring.unlink()  # every local reader has attached: nothing can leak from now on
        if self._local_pub is not None:
            self._local_pub.unlink_path()

    # ---- writer ------------------------------------------------------------------------------
    def enqueue(self, obj: Any, timeout: float | None = None) -> None:
        """Broadcast ``obj``. Blocks (bounded by ``timeout``) while a reader holds the slot."""
        if not self.is_writer:
            raise RuntimeError(f"{self._who()}: only the writer can enqueue")
        with self._op_lock:
            self._raise_if_closing()
            deadline = _deadline(timeout)
            self._wait_ready_locked(deadline)
            n, ring = self._next, self._ring
            if ring is not None:
                self._acquire_chunk(n, deadline)
                chunk = ring.chunks[ring.chunk_of(n)]
                enc = self._encoder.encode_into(obj, chunk, lambda: ring.mark_copying(n))
            else:
                enc = self._encoder.encode_into(obj, None)
            # Remote first: if it times out nothing was published, so the caller may retry.
            if self._remote_pub is not None:
                frames = enc.frames() if enc is not None else ser.inline_frames(chunk)
                self._remote_pub.send(KIND_MSG, frames, self._send_tick(deadline))
            if ring is not None:
                if enc is not None:  # too big for a chunk: over the socket, a marker here
                    self._local_pub.send(KIND_MSG, enc.frames(), self._send_tick(deadline))
                    ser.write_overflow_marker(chunk)
                ring.publish(n, self._notify)
            self._next = n + 1

    def _send_tick(self, deadline: float | None) -> Callable[[], float]:
        wait = BoundedWait(self, deadline, lambda: "a remote reader is 1000 messages behind",
                     lambda: None)
        return wait.tick

    def _acquire_chunk(self, n: int, deadline: float | None) -> None:
        ring = self._ring
        prev = (n - self.max_chunks) & 0xFFFF_FFFF
        if ring.blocker(n) < 0:
            return
        wait = BoundedWait(self, deadline, lambda: self._describe_blocker(n),
                     lambda: self._check_blocker_alive(n))
        words, chunk = ring.words, ring.chunk_of(n)
        spin_end = time.perf_counter() + self._spin_s
        while (r := ring.blocker(n)) >= 0:
            idx = ring.read_index(chunk, r)
            seen = words[idx]
            if seen == prev:
                continue
            if time.perf_counter() < spin_end:
                _yield()
                continue
            self._sleep(ring.addr(idx), seen, wait.tick())

    def _describe_blocker(self, n: int) -> str:
        r = self._ring.blocker(n)
        if r < 0:
            return "nothing (the slot was just released)"
        pid = self._ring.reader_info(r)[0]
        return (f"reader {self._reader_desc(r)} has not released chunk "
                f"{self._ring.chunk_of(n)} (message {n - self.max_chunks}); that process is "
                f"busy or hung (`py-spy dump --pid {pid}` shows where)")

    def _check_blocker_alive(self, n: int) -> None:
        r = self._ring.blocker(n)
        if r < 0:
            return
        pid, start, closed = self._ring.reader_info(r)
        if closed or not wakeup.process_alive(pid, start):
            how = "closed its end" if closed else "is gone (process exited or was killed)"
            raise PeerGone(f"{self._who()}: reader {self._reader_desc(r)} {how} without "
                           f"releasing chunk {self._ring.chunk_of(n)} "
                           f"(message {n - self.max_chunks})")

    # ---- reader ------------------------------------------------------------------------------
    def dequeue(self, timeout: float | None = None) -> Any:
        """Next message, in order. ``TimeoutError`` after ``timeout`` s, ``QueueClosed`` when
        this end or the writer is closed (or the writer process is gone)."""
        if self.is_writer:
            raise RuntimeError(f"{self._who()}: only readers can dequeue")
        with self._op_lock:
            self._raise_if_closing()
            deadline = _deadline(timeout)
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
                raise PeerGone(f"{self._who()}: the writer at {self._remote_addr} has been "
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

    # ---- waiting and closing -----------------------------------------------------------------
    def _sleep(self, addr: int, seen: int, timeout_s: float) -> None:
        """Sleep on a ring word; announced, so the other side knows to send a wake-up."""
        self._wait_addr = addr
        ring = self._ring
        ring.set_sleeping(self.rank, True)
        try:
            wakeup.futex_wait(addr, seen, timeout_s)
        finally:
            ring.set_sleeping(self.rank, False)
            self._wait_addr = 0

    def is_sleeping(self, rank: int | None = None) -> bool:
        """Whether local reader `rank` (None: the writer) is blocked in a wait on the ring right
        now, as its ring header announces (read-only; for tests and diagnostics). Any side with
        the ring mapped may ask; remote readers wait on ZMQ and have no such word."""
        if self._ring is None or (rank is not None and not 0 <= rank < self.n_local_reader):
            raise ValueError(f"{self._who()}: rank {rank} has no sleeping word on this ring")
        return self._ring.is_sleeping(rank)

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
        if self._released:
            return
        self._released = True
        ring = self._ring
        if ring is not None:
            if self.is_writer:
                ring.mark_writer_closed()
            else:
                ring.mark_reader_closed(self.rank)
        for pub in (self._local_pub, self._remote_pub):
            if pub is not None:
                pub.close(announce=True)
        if not self.is_writer and self._sub is not None:
            self._sub.close()
        if ring is not None:
            ring.close()

    def __enter__(self) -> MessageQueue:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __reduce__(self) -> Any:
        raise TypeError("a MessageQueue cannot be pickled; send export_handle() instead")


def _deadline(timeout: float | None) -> float | None:
    return None if timeout is None else time.monotonic() + max(0.0, timeout)


def _host_ip() -> str:
    """An address of this host that other hosts can likely reach (no packet is sent)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.255", 1))
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"
