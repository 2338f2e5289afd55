"""Authentication of every MessageQueue TCP connection with CurveZMQ, keyed by a secret.

Without it, anyone who could reach a remote publisher's port could subscribe, read every
broadcast (prompt token ids included) and, by never reading, stall the writer (XPUB_NODROP
turns a full subscriber into back-pressure). With it, a connection is encrypted and admitted
only after the CURVE handshake proves that the peer holds the client secret key:

    secret (SHARDSERVE_CLUSTER_SECRET, else 32 random bytes per queue)
      ├─ HMAC-SHA256(secret, "shardserve-curve-server") -> server secret key -> server public key
      └─ HMAC-SHA256(secret, "shardserve-curve-client") -> client secret key -> client public key

The writer's socket is a CURVE server with the server keys; a ZAP handler (one authenticator
thread per process, a daemon on the shared ZMQ context, kept once started) admits a client only
if its long-term public key is the one derived for that queue (ZAP domain = the queue's).
Readers get the client keys and the server's public key in the queue's handle, never the
secret itself. A peer without them
never completes the handshake: libzmq gives it no pipe, so it receives nothing and cannot slow
the writer; it is dropped when the handshake interval runs out.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import threading
import time
from dataclasses import dataclass

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

from shardserve import envs
from shardserve.idle_threads import count_as_idle

logger = logging.getLogger(__name__)

# Both sides: ZMTP heartbeats, so a peer that vanished without closing its connection (a crashed
# host, a cut cable) is noticed within HEARTBEAT_TIMEOUT and its pipe closed.
HEARTBEAT_IVL_MS = 1000
HEARTBEAT_TIMEOUT_MS = 4000
HANDSHAKE_IVL_MS = 5000  # a connection that has not authenticated by then is closed
_WARN_EVERY_S = 10.0


@dataclass(frozen=True)
class CurveKeys:
    """z85-encoded keys; a reader's copy has no server_secret."""

    server_public: bytes
    client_public: bytes
    client_secret: bytes
    server_secret: bytes = b""

    @classmethod
    def from_secret(cls, secret: bytes) -> CurveKeys:
        server_secret = _derive(secret, b"shardserve-curve-server")
        client_secret = _derive(secret, b"shardserve-curve-client")
        return cls(zmq.curve_public(server_secret), zmq.curve_public(client_secret),
                   client_secret, server_secret)

    def for_reader(self) -> CurveKeys:
        return CurveKeys(self.server_public, self.client_public, self.client_secret)

    def __repr__(self) -> str:  # keys never appear in logs or tracebacks
        return f"CurveKeys(server_public={self.server_public[:6].decode()}...)"


def _derive(secret: bytes, label: bytes) -> bytes:
    return z85.encode(hmac.new(secret, label, hashlib.sha256).digest())


def queue_keys() -> CurveKeys:
    """Keys for a new queue: from SHARDSERVE_CLUSTER_SECRET when set (so processes started apart
    agree), else from a fresh random secret that only the queue's handle carries onward."""
    if not zmq.has("curve"):
        raise RuntimeError("this pyzmq's libzmq was built without CURVE security, which the "
                           "MessageQueue's TCP path requires; install a pyzmq wheel (they "
                           "bundle a libzmq with CURVE)")
    secret = envs.cluster_secret()
    return CurveKeys.from_secret(secret.encode() if secret else secrets.token_bytes(32))


def secure_server(sock: zmq.Socket, keys: CurveKeys, domain: str) -> None:
    """Make `sock` (before bind) a CURVE server admitting only `keys`' client."""
    _Gate.admit(domain, keys.client_public)
    sock.setsockopt(zmq.ZAP_DOMAIN, domain.encode())
    sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
    sock.setsockopt(zmq.CURVE_SERVER, 1)
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.server_secret)
    _common(sock)


def secure_client(sock: zmq.Socket, keys: CurveKeys) -> None:
    """Make `sock` (before connect) a CURVE client of the server `keys` name."""
    sock.setsockopt(zmq.CURVE_SERVERKEY, keys.server_public)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.client_public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.client_secret)
    _common(sock)


def release(domain: str) -> None:
    """The server socket of `domain` is closed: forget its client key."""
    _Gate.release(domain)


def _common(sock: zmq.Socket) -> None:
    sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
    sock.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_IVL_MS)


class _Gate:
    """The process's ZAP handler: which client key each domain admits. Started with the first
    secured socket on the context the queue's sockets use, and kept (a daemon thread): a handler
    stopped and restarted at once can collide with its predecessor's ZAP endpoint, which libzmq
    releases only after the old socket is reaped."""

    _lock = threading.Lock()
    _allowed: dict[str, bytes] = {}
    _auth: ThreadAuthenticator | None = None
    _pid = 0  # the process that started _auth (a forked child starts its own)
    _last_warning: dict[str, float] = {}

    @classmethod
    def admit(cls, domain: str, client_public: bytes) -> None:
        with cls._lock:
            if cls._auth is None or cls._pid != os.getpid():
                cls._allowed = {}
                cls._auth = ThreadAuthenticator(zmq.Context.instance(), log=logger)
                cls._auth.start()
                cls._pid = os.getpid()
                # With no domain admitted, every secured server socket is closed: no ZAP
                # request can come, and the thread only polls its own sockets.
                count_as_idle(cls._auth.thread, lambda: not cls._allowed)
            cls._allowed[domain] = client_public
            cls._auth.configure_curve_callback(domain, credentials_provider=cls)

    @classmethod
    def callback(cls, domain: str, client_key: bytes) -> bool:
        """ZAP: is `client_key` (z85) the one `domain` admits? (called on the auth thread)"""
        allowed = cls._allowed.get(domain)
        ok = allowed is not None and hmac.compare_digest(allowed, client_key)
        now = time.monotonic()
        # A refused peer reconnects every ~100 ms: say so once per domain every 10 s.
        if not ok and now - cls._last_warning.get(domain, -_WARN_EVERY_S) >= _WARN_EVERY_S:
            cls._last_warning[domain] = now
            logger.warning("refused a TCP connection to %r: it does not hold the cluster's key "
                           "(SHARDSERVE_CLUSTER_SECRET)", domain)
        return ok

    @classmethod
    def release(cls, domain: str) -> None:
        with cls._lock:
            cls._allowed.pop(domain, None)
