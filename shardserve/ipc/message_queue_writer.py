"""MessageQueueWriter: the end that owns the queue, hands out its handle and broadcasts.

message_queue.py has the overview; shm_ring.py the ring's layout and flag protocol.
"""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import Callable
from typing import Any

from shardserve import envs
from shardserve.ipc import serialization as ser
from shardserve.ipc import wakeup
from shardserve.ipc.errors import PeerGone
from shardserve.ipc.host_address import reachable_ip
from shardserve.ipc.message_queue import Handle, MessageQueue, deadline_of
from shardserve.ipc.shm_ring import ShmRing
from shardserve.ipc.waiting import BoundedWait
from shardserve.ipc.zmq_channel import KIND_MSG, KIND_READY, Publisher

_yield = os.sched_yield


class MessageQueueWriter(MessageQueue):
    """Creates the ring (local readers) and the publishers (overflow, remote readers); readers
    attach with ``export_handle()``'s value; ``enqueue`` broadcasts to all of them."""

    def __init__(self, n_reader: int, n_local_reader: int, max_chunk_bytes: int = 1 << 24,
                 max_chunks: int = 10, connect_ip: str | None = None, *,
                 name: str | None = None, spin_us: float | None = None,
                 recheck_ms: float | None = None, warn_interval_s: float | None = None,
                 notify: bool | None = None) -> None:
        _check_geometry(n_reader, n_local_reader, max_chunk_bytes, max_chunks)
        super().__init__(name or f"mq-{secrets.token_hex(3)}", n_reader, n_local_reader,
                         max_chunk_bytes, max_chunks, spin_us, recheck_ms, warn_interval_s,
                         sleep_slot=None)
        self._notify = not envs.ipc_drop_notify() if notify is None else notify
        self._encoder = ser.Encoder(envs.ipc_oob_threshold())
        self._local_pub: Publisher | None = None
        self._remote_pub: Publisher | None = None
        try:
            if n_local_reader:
                self._ring = ShmRing.create(n_local_reader, max_chunk_bytes, max_chunks)
                self._local_pub = Publisher("ipc", name=self.name, n_reader=n_local_reader)
            if n_reader > n_local_reader:
                self._remote_pub = Publisher("tcp", connect_ip or reachable_ip(),
                                             name=self.name, n_reader=n_reader)
        except BaseException:
            self._release()
            raise
        self.handle = self._make_handle()

    def _make_handle(self) -> Handle:
        ring, local, remote = self._ring, self._local_pub, self._remote_pub
        return Handle(self.n_reader, self.n_local_reader, self.max_chunk_bytes, self.max_chunks,
                      ring.name if ring else None, local.addr if local else None,
                      remote.addr if remote else None, os.getpid(), self.name, self.recheck_s,
                      self.warn_interval_s,
                      remote.keys.for_reader() if remote and remote.keys else None)

    def export_handle(self) -> Handle:
        """What a reader process needs to attach (``MessageQueueReader.from_handle``)."""
        return self.handle

    def _role(self) -> str:
        return "writer"

    def _reader_desc(self, r: int) -> str:
        if r >= self.n_local_reader:
            return f"rank {r} (remote)"
        pid = self._ring.reader_info(r)[0] if self._ring else 0
        return f"rank {r} (pid {pid})" if pid else f"rank {r} (not attached yet)"

    # ---- readiness -------------------------------------------------------------------------
    def _missing_readers(self) -> list[int]:
        """Ranks not connected yet; a local one also counts until it is attached to the ring."""
        missing = []
        for r in range(self.n_reader):
            pub = self._local_pub if r < self.n_local_reader else self._remote_pub
            attached = r >= self.n_local_reader or self._ring.reader_info(r)[0] != 0
            if not attached or r not in pub.connected:
                missing.append(r)
        return missing

    def _handshake(self, deadline: float | None) -> None:
        def describe() -> str:
            names = ", ".join(self._reader_desc(r) for r in self._missing_readers())
            return f"readers not connected yet: {names}"

        wait = BoundedWait(self, deadline, describe, lambda: None)
        pubs = [p for p in (self._local_pub, self._remote_pub) if p is not None]
        while self._missing_readers():
            slice_s = wait.tick() / len(pubs)
            for pub in pubs:
                pub.poll_hellos(slice_s)
        for pub in pubs:
            pub.send(KIND_READY, [], wait.tick)
        if self._ring is not None:
            self._ring.unlink()  # every local reader has attached: nothing can leak from now on
        if self._local_pub is not None:
            self._local_pub.unlink_path()

    # ---- writing ---------------------------------------------------------------------------
    def enqueue(self, obj: Any, timeout: float | None = None) -> None:
        """Broadcast ``obj``. Blocks (bounded by ``timeout``) while a reader holds the slot."""
        with self._op_lock:
            self._raise_if_closing()
            deadline = deadline_of(timeout)
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
                ring.publish(n, self._notify)  # last: local readers may read from here on
            self._next = n + 1

    def _send_tick(self, deadline: float | None) -> Callable[[], float]:
        wait = BoundedWait(self, deadline, lambda: "a remote reader is 1000 messages behind",
                           lambda: None)
        return wait.tick

    def _acquire_chunk(self, n: int, deadline: float | None) -> None:
        """Wait until every local reader released the chunk's previous occupant (shm_ring.py)."""
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

    # ---- closing -----------------------------------------------------------------------------
    def _close_ends(self) -> None:
        if self._ring is not None:
            self._ring.mark_writer_closed()  # a reader sleeping on the ring sees it at once
        for pub in (self._local_pub, self._remote_pub):
            if pub is not None:
                pub.close(announce=True)  # KIND_CLOSE: readers on the sockets get QueueClosed


def _check_geometry(n_reader: int, n_local_reader: int, max_chunk_bytes: int,
                    max_chunks: int) -> None:
    if not 0 <= n_local_reader <= n_reader or n_reader < 1:
        raise ValueError(f"need 0 <= n_local_reader ({n_local_reader}) <= n_reader "
                         f"({n_reader}) and n_reader >= 1")
    if max_chunk_bytes < 64 or max_chunks < 1:
        raise ValueError("max_chunk_bytes must be >= 64 and max_chunks >= 1")
