"""Strangers for the authentication tests: sockets without the cluster's keys (none at all, or
keys from another secret) and a raw TCP connection that sends junk, all connected to a port
that must admit nobody but the cluster's own processes."""

from __future__ import annotations

import socket
from typing import Any

import zmq

from shardserve.ipc.curve_auth import CurveKeys


def strangers(addr: str, kind: int = zmq.SUB) -> list[Any]:
    """[plain, wrong-keys, raw] connected to `addr` ("tcp://host:port"). SUB sockets subscribe
    with a 1-message buffer (one admitted to a NODROP writer would stall it at once); others
    pretend to be node 1 and send junk."""
    ctx = zmq.Context.instance()
    plain, wrong = ctx.socket(kind), ctx.socket(kind)
    other = CurveKeys.from_secret(b"not the secret")
    wrong.setsockopt(zmq.CURVE_SERVERKEY, other.server_public)
    wrong.setsockopt(zmq.CURVE_PUBLICKEY, other.client_public)
    wrong.setsockopt(zmq.CURVE_SECRETKEY, other.client_secret)
    for sock in (plain, wrong):
        sock.setsockopt(zmq.LINGER, 0)
        if kind == zmq.SUB:
            sock.setsockopt(zmq.SUBSCRIBE, b"")
            sock.setsockopt(zmq.RCVHWM, 1)
        else:
            sock.setsockopt(zmq.IDENTITY, b"node-1")
        sock.connect(addr)
        if kind != zmq.SUB:
            sock.send(b"\x80junk that is not a pickle")
    host, port = addr.removeprefix("tcp://").rsplit(":", 1)
    raw = socket.create_connection((host, int(port)), timeout=5)
    if kind != zmq.SUB:
        raw.sendall(b"GET / HTTP/1.0\r\n\r\n" * 10)
    return [plain, wrong, raw]


def raw_bytes(raw: socket.socket) -> bytes:
    """What a raw connection received (ZMTP's greeting at most, for a stranger)."""
    raw.settimeout(0.3)
    try:
        return raw.recv(1 << 16)
    except (TimeoutError, ConnectionResetError):
        return b""


def assert_received_nothing(socks: list[Any]) -> None:
    for sock in socks:
        if isinstance(sock, socket.socket):
            data = raw_bytes(sock)
            assert len(data) <= 64, data  # the greeting names the mechanism; never a message
        else:
            assert sock.poll(300) == 0, "a stranger received a message"
