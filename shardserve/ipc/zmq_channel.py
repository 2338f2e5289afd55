"""ZMQ side channels of a MessageQueue.

* local overflow: XPUB on ``ipc://`` carries messages too big for a ring chunk (the ring holds a
  marker in their place, so order is kept);
* remote readers: XPUB on ``tcp://connect_ip:<port chosen by the OS at bind>`` carries every
  message.

XPUB rather than PUB: each reader subscribes to a topic naming its rank, so the writer knows who
is connected (and can name who is missing), and ``XPUB_NODROP`` turns the silent drop of a slow
subscriber at the high-water mark into back-pressure that the writer waits on with a deadline.
"""

from __future__ import annotations

import os
import tempfile
import time
import weakref
from collections.abc import Callable
from typing import Any

import zmq

from shardserve.ipc.shm_ring import register_unlink

KIND_MSG = b"M"
KIND_READY = b"R"
KIND_CLOSE = b"C"
_HELLO = b"\xffshardserve-reader-"
_SEND_RETRY_S = 0.0005
_CLOSE_LINGER_MS = 2000  # queued messages still reach readers after the writer closes


def hello_topic(rank: int) -> bytes:
    return _HELLO + str(rank).encode()


def _context() -> zmq.Context:
    return zmq.Context.instance()


class Publisher:
    """Writer end: binds, tracks which reader ranks subscribed, sends with bounded waits."""

    def __init__(self, transport: str, host: str | None = None) -> None:
        self.sock = _context().socket(zmq.XPUB)
        self.sock.setsockopt(zmq.XPUB_VERBOSE, 1)
        self.sock.setsockopt(zmq.XPUB_NODROP, 1)
        self.sock.setsockopt(zmq.SNDHWM, 1000)
        self.sock.setsockopt(zmq.LINGER, 0)  # until close() picks a linger
        self.connected: set[int] = set()
        self._path: str | None = None
        self._finalizer: weakref.finalize | None = None
        try:
            self.addr = self._bind(transport, host)
        except BaseException:
            self.sock.close(linger=0)
            raise

    def _bind(self, transport: str, host: str | None) -> str:
        if transport == "ipc":
            # In a private directory (mkdtemp: mode 0700), so no other user can connect to the
            # socket or even see it; libzmq leaves the file behind, so the file and the
            # directory go at close, GC or exit.
            folder = tempfile.mkdtemp(prefix=f"shardserve-mq-{os.getpid()}-")
            self._path = os.path.join(folder, "overflow.sock")
            self._finalizer = register_unlink(self, self._path, remove_parent=True)
            self.sock.bind(f"ipc://{self._path}")
            return f"ipc://{self._path}"

        assert host is not None
        if ":" in host:  # IPv6 literal
            self.sock.setsockopt(zmq.IPV6, 1)
            host = f"[{host}]"
        port = self.sock.bind_to_random_port(f"tcp://{host}")  # the OS picks: no race
        return f"tcp://{host}:{port}"

    def unlink_path(self) -> None:
        """Remove the ipc:// file; connected peers keep their connections."""
        if self._finalizer is not None:
            self._finalizer()

    def poll_hellos(self, timeout_s: float) -> None:
        """Read (un)subscription notices for up to ``timeout_s``; updates ``connected``."""
        if not self.sock.poll(max(0, int(timeout_s * 1000)), zmq.POLLIN):
            return
        while True:
            try:
                msg = self.sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            if msg[1:].startswith(_HELLO):
                rank = int(msg[1 + len(_HELLO) :])
                (self.connected.add if msg[:1] == b"\x01" else self.connected.discard)(rank)

    def send(self, kind: bytes, frames: list[Any], tick: Callable[[], float]) -> None:
        """Send one multipart message; ``tick`` raises on timeout/close while we are blocked.

        copy=True: the caller may modify its buffers as soon as enqueue returns, and libzmq
        sends from its I/O thread later.
        """
        parts = [kind, *frames]
        while True:
            try:
                self.sock.send_multipart(parts, flags=zmq.NOBLOCK, copy=True)
                return
            except zmq.Again:  # a subscriber is at the high-water mark (NODROP)
                time.sleep(min(_SEND_RETRY_S, tick()))

    def close(self, announce: bool) -> None:
        if announce:
            try:
                self.sock.send(KIND_CLOSE, zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        self.sock.close(linger=_CLOSE_LINGER_MS if announce else 0)
        self.unlink_path()


class Subscriber:
    """Reader end: subscribes to everything plus a topic naming its rank (seen by the writer)."""

    def __init__(self, addr: str, rank: int) -> None:
        self.sock = _context().socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        if addr.startswith("tcp://["):
            self.sock.setsockopt(zmq.IPV6, 1)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.setsockopt(zmq.SUBSCRIBE, hello_topic(rank))
        self.sock.connect(addr)

    def try_recv(self) -> list[zmq.Frame] | None:
        try:
            return self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return None

    def wait(self, timeout_s: float) -> None:
        self.sock.poll(max(1, int(timeout_s * 1000)), zmq.POLLIN)

    def close(self) -> None:
        self.sock.close(linger=0)
