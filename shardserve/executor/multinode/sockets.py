"""The link's sockets: node 0's port per replica, a headless node's DEALER, sending and reading
one message (the frames are in messages.py)."""

from __future__ import annotations

import logging
import os
import pickle
import secrets

import zmq

from shardserve.config import ParallelConfig
from shardserve.ipc.curve_auth import CurveKeys, secure_client

logger = logging.getLogger(__name__)

POLL_MS = 100  # how often the loops of both sides look at their clocks between messages


def link_port(pc: ParallelConfig, replica: int) -> int:
    """Node 0's port for replica `replica`'s link (one engine core each)."""
    return pc.multinode.master_port + replica


def client_socket(pc: ParallelConfig, replica: int, keys: CurveKeys) -> zmq.Socket:
    """A headless node's DEALER to replica `replica`'s engine core on node 0 (connects, and
    reconnects, in the background)."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    secure_client(sock, keys)
    # Unique per process: two nodes started with the same rank must not share an identity
    # (a ROUTER would silently ignore the second), so node 0 can refuse the second by name.
    sock.setsockopt(zmq.IDENTITY, f"node-{pc.multinode.node_rank}-{os.getpid()}-"
                                  f"{secrets.token_hex(4)}".encode())
    sock.setsockopt(zmq.LINGER, 1000)
    sock.connect(f"tcp://{pc.multinode.master_addr}:{link_port(pc, replica)}")
    return sock


def send(sock: zmq.Socket, message: object, identity: bytes | None = None) -> None:
    """One message; `identity` addresses a node from node 0's ROUTER."""
    frames = [pickle.dumps(message)]
    sock.send_multipart(frames if identity is None else [identity, *frames], zmq.NOBLOCK)


def recv_routed(sock: zmq.Socket) -> tuple[bytes, object, int]:
    """(sender identity, message or None if unreadable, the connection's fd) from node 0's
    ROUTER. Only peers the CURVE handshake admitted get here."""
    frames = sock.recv_multipart(copy=False)
    identity, fd = frames[0].bytes, frames[-1].get(zmq.SRCFD)
    try:
        if len(frames) != 2:
            raise ValueError(f"{len(frames)} frames")
        return identity, pickle.loads(frames[1].buffer), fd
    except Exception as e:  # an admitted peer of another version, say: not fatal here
        logger.warning("dropped an unreadable message from %r: %s", identity, e)
        return identity, None, fd
