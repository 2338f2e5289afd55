"""ZMQ side channels of a MessageQueue.

* local overflow: XPUB on ``ipc://`` carries messages too big for a ring chunk (the ring holds a
  marker in their place, so order is kept);
* remote readers: XPUB on ``tcp://connect_ip:<port chosen by the OS at bind>`` carries every
  message; every connection is authenticated and encrypted with CurveZMQ (curve_auth.py), and a
  remote reader watches its connection (ZMTP heartbeats and a socket monitor), so a writer that
  is gone ends its wait instead of leaving it waiting for ever.

XPUB rather than PUB: each reader subscribes to a topic naming its rank, so the writer knows who
is connected (and can name who is missing), and ``XPUB_NODROP`` turns the silent drop of a slow
subscriber at the high-water mark into back-pressure that the writer waits on with a deadline.
"""

from __future__ import annotations

import logging
import os
import secrets
import tempfile
import time
import weakref
from collections.abc import Callable
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from shardserve.ipc import curve_auth
from shardserve.ipc.curve_auth import CurveKeys
from shardserve.ipc.shm_ring import register_unlink

logger = logging.getLogger(__name__)

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

    def __init__(self, transport: str, host: str | None = None, name: str = "mq",
                 n_reader: int = 0) -> None:
        self.n_reader = n_reader  # ranks above this in a hello are malformed
        self.keys: CurveKeys | None = None
        self._domain: str | None = None
        self.sock = _context().socket(zmq.XPUB)
        self.sock.setsockopt(zmq.XPUB_VERBOSE, 1)
        self.sock.setsockopt(zmq.XPUB_NODROP, 1)
        self.sock.setsockopt(zmq.SNDHWM, 1000)
        self.sock.setsockopt(zmq.LINGER, 0)  # until close() picks a linger
        self.connected: set[int] = set()
        self.name_hint = name
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
        self.keys = curve_auth.queue_keys()
        self._domain = f"{self.name_hint}-{secrets.token_hex(4)}"
        curve_auth.secure_server(self.sock, self.keys, self._domain)
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
                self._hello(msg)

    def _hello(self, msg: bytes) -> None:
        """A (un)subscription naming a reader rank; anything malformed is logged and dropped
        (only an authenticated peer can send one, but it must not break the handshake)."""
        try:
            rank = int(msg[1 + len(_HELLO) :])
        except ValueError:
            rank = -1
        if msg[:1] not in (b"\x00", b"\x01") or not 0 <= rank < max(self.n_reader, 1):
            logger.warning("MessageQueue %r: dropped a malformed reader hello %r",
                           self.name_hint, msg[:64])
            return
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
        if self._domain is not None:
            curve_auth.release(self._domain)
            self._domain = None


class Subscriber:
    """Reader end: subscribes to everything plus a topic naming its rank (seen by the writer).
    Over TCP it authenticates with `keys` and watches its connection (`writer_gone_for`)."""

    def __init__(self, addr: str, rank: int, keys: CurveKeys | None = None) -> None:
        self.sock = _context().socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self._monitor: zmq.Socket | None = None
        self._down_since: float | None = time.monotonic()  # not connected yet
        if addr.startswith("tcp://"):
            if keys is None:
                self.sock.close(linger=0)
                raise ValueError("a TCP reader needs the queue's keys (from its handle)")
            curve_auth.secure_client(self.sock, keys)
            self._monitor = self.sock.get_monitor_socket(
                zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
        if addr.startswith("tcp://["):
            self.sock.setsockopt(zmq.IPV6, 1)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.setsockopt(zmq.SUBSCRIBE, hello_topic(rank))
        self.sock.connect(addr)

    def writer_gone_for(self) -> float:
        """Seconds since the authenticated connection to the writer was last up (0 while it
        is; always 0 over ipc://, where the ring tells whether the writer lives)."""
        if self._monitor is None:
            return 0.0
        while self._monitor.poll(0):
            event = recv_monitor_message(self._monitor)["event"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._down_since = None
            elif event == zmq.EVENT_DISCONNECTED and self._down_since is None:
                self._down_since = time.monotonic()
        return 0.0 if self._down_since is None else time.monotonic() - self._down_since

    def try_recv(self) -> list[zmq.Frame] | None:
        try:
            return self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return None

    def wait(self, timeout_s: float) -> None:
        self.sock.poll(max(1, int(timeout_s * 1000)), zmq.POLLIN)

    def close(self) -> None:
        if self._monitor is not None:
            self.sock.disable_monitor()
            self._monitor.close(linger=0)
        self.sock.close(linger=0)
