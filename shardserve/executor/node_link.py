"""The multi-node handshake of the mp backend: messages, keys, and node 0's side (RemoteNodes).

One authenticated ZMQ connection per headless node, node 0 listening:

    node 0: engine + MultiprocExecutor                node R: `shardserve serve --headless`
    ROUTER tcp://master_addr:master_port + i          DEALER, identity b"node-R-<pid>-<random>"
    (replica i; CURVE server, ZAP admits the          (CURVE client, keys from the secret)
    cluster's key)
                                  ◀── NodeHello(node_rank, ip, pid, nnodes, world_size,
                                                data_parallel_size, replica)  once a second
    NodeStart(config, broadcast handle, torch
              init_method, ranks)             ──▶ starts its ranks' worker processes
                                  ◀── NodeReady({rank: reply-queue handle}) | NodeFailed(why)
    Heartbeat every 0.2 s                     ◀─▶ Heartbeat every 0.2 s
      its connection closed (socket monitor,      node 0 silent 5 s (2 s once the connection
      matched by fd), or silent 2.5 s once        closed) → stop workers, exit 1
      ready → node dead (EngineDeadError)
                                  ◀── NodeFailed(a worker died)
    NodeStop(reason)                          ──▶ stop its workers, NodeBye, exit

The payloads are pickled dataclasses; they are unpickled only from peers the CURVE handshake
admitted (a stranger gets no pipe, so it sends and receives nothing). The data itself then
flows through the MessageQueues: the broadcast's TCP path to remote ranks, one TCP reply queue
per remote rank (their keys travel inside the handles, over this link).
"""

from __future__ import annotations

import logging
import os
import pickle
import secrets
import shlex
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq
from zmq.utils.monitor import recv_monitor_message

from shardserve import envs
from shardserve.config import EngineConfig, ParallelConfig
from shardserve.errors import WorkerStartupError
from shardserve.ipc import Handle
from shardserve.ipc.curve_auth import CurveKeys, release, secure_client, secure_server

logger = logging.getLogger(__name__)

HEARTBEAT_S = 0.2
NODE_SILENT_S = 2.5  # node 0 declares a headless node dead after this long without a word
MASTER_SILENT_S = 5.0  # a headless node gives up on node 0 after this long
_POLL_MS = 100


@dataclass(frozen=True)
class NodeHello:
    node_rank: int
    ip: str  # where this node's reply queues listen
    pid: int
    nnodes: int
    world_size: int
    data_parallel_size: int
    replica: int  # which replica's ranks it offers (it talks to master_port + replica)


@dataclass(frozen=True)
class NodeStart:
    config: EngineConfig
    broadcast: Handle
    init_method: str
    ranks: tuple[int, ...]


@dataclass(frozen=True)
class NodeReady:
    reply_handles: dict[int, Handle]


@dataclass(frozen=True)
class NodeFailed:
    reason: str


@dataclass(frozen=True)
class Heartbeat:
    pass


@dataclass(frozen=True)
class NodeStop:
    reason: str = ""


@dataclass(frozen=True)
class NodeBye:
    pass


def link_keys() -> CurveKeys:
    """The link's keys, from SHARDSERVE_CLUSTER_SECRET (which both sides must hold)."""
    secret = envs.cluster_secret()
    if secret is None:
        raise ValueError("SHARDSERVE_CLUSTER_SECRET is not set: every node must hold the secret "
                         "node 0 printed when it started (or one you chose for all of them)")
    return CurveKeys.from_secret(secret.encode())


def ensure_cluster_secret(config: EngineConfig) -> None:
    """Node 0 without SHARDSERVE_CLUSTER_SECRET: make one and print how to start the others."""
    if envs.cluster_secret() is not None:
        return
    pc = config.parallel_config
    model = config.model_config.model or str(config.model_config.path)
    secret = secrets.token_hex(16)
    os.environ["SHARDSERVE_CLUSTER_SECRET"] = secret  # our queues derive their keys from it too
    for rank in range(1, pc.multinode.nnodes):
        command = (f"SHARDSERVE_CLUSTER_SECRET={secret} shardserve serve {shlex.quote(model)} "
                   f"--headless --nnodes {pc.multinode.nnodes} --node-rank {rank} "
                   f"--master-addr {pc.multinode.master_addr} "
                   f"--master-port {pc.multinode.master_port} "
                   f"--tensor-parallel-size {pc.tensor_parallel_size} "
                   f"--pipeline-parallel-size {pc.pipeline_parallel_size}"
                   f"{f' --data-parallel-size {dp}' if (dp := pc.data_parallel_size) > 1 else ''}")
        print(f"shardserve: start node {rank} with:\n  {command}", file=sys.stderr, flush=True)


def route_ip(master_addr: str, master_port: int) -> str:
    """This machine's address on the route to node 0 (what node 0 can reach us at)."""
    if ip := envs.host_ip():
        return ip
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((master_addr, master_port))  # UDP: no packet is sent
        return s.getsockname()[0]


def send(sock: zmq.Socket, message: object, identity: bytes | None = None) -> None:
    frames = [pickle.dumps(message)]
    sock.send_multipart(frames if identity is None else [identity, *frames], zmq.NOBLOCK)


def link_port(pc: ParallelConfig, replica: int) -> int:
    return pc.multinode.master_port + replica


def client_socket(pc: ParallelConfig, replica: int) -> zmq.Socket:
    """A headless node's DEALER to replica `replica`'s engine core on node 0 (connects, and
    reconnects, in the background)."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    secure_client(sock, link_keys())
    # Unique per process: two nodes started with the same rank must not share an identity
    # (a ROUTER would silently ignore the second), so node 0 can refuse the second by name.
    sock.setsockopt(zmq.IDENTITY, f"node-{pc.multinode.node_rank}-{os.getpid()}-"
                                  f"{secrets.token_hex(4)}".encode())
    sock.setsockopt(zmq.LINGER, 1000)
    sock.connect(f"tcp://{pc.multinode.master_addr}:{link_port(pc, replica)}")
    return sock


@dataclass
class _Node:
    rank: int
    identity: bytes
    hello: NodeHello
    ranks: tuple[int, ...]
    last_seen: float = field(default_factory=time.monotonic)
    ready: NodeReady | None = None
    gone: bool = False
    fd: int = -1  # its connection's socket (a closed one names the node that left)

    def describe(self) -> str:
        return (f"node {self.rank} ({self.hello.ip}, ranks {list(self.ranks)}, "
                f"agent pid {self.hello.pid})")


class RemoteNodes:
    """Node 0's side of the link of one engine core (replica): gathers the headless nodes that
    hold its ranks, starts them, watches them.

    The socket belongs to the calling thread until `start_nodes` returns, then to the watch
    thread alone (ZMQ sockets are not thread-safe); `stop` asks that thread to finish.
    """

    def __init__(self, pc: ParallelConfig, on_failure: Callable[[str], None]) -> None:
        self.pc = pc
        self.replica = pc.data_parallel_rank
        self.port = link_port(pc, self.replica)
        self.expected = sorted(set(pc.layout.nodes_of_replica(self.replica)) - {0})
        self.failure: str | None = None
        self.nodes: dict[int, _Node] = {}
        self._on_failure = on_failure
        self._ready = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._domain = f"shardserve-nodes-{os.getpid()}-{self.port}"
        addr = pc.multinode.master_addr
        if addr.startswith("127.") or addr in ("localhost", "::1"):
            logger.warning("nnodes=%d with master_addr=%s: only processes on this machine can "
                           "join; give --master-addr this machine's address on the network the "
                           "other nodes share", pc.multinode.nnodes, pc.multinode.master_addr)
        self._sock = zmq.Context.instance().socket(zmq.ROUTER)
        self._monitor: zmq.Socket | None = None
        try:
            secure_server(self._sock, link_keys(), self._domain)
            self._sock.setsockopt(zmq.LINGER, 0)
            self._monitor = self._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
            self._sock.bind(f"tcp://{pc.multinode.master_addr}:{self.port}")
        except zmq.ZMQError as e:
            self._close_socket()
            raise RuntimeError(f"cannot listen for the other nodes on {pc.multinode.master_addr}:"
                               f"{self.port} ({e}); choose another --master-port (replica i "
                               f"listens on master_port + i)") from e

    # ---- start-up (calling thread) ----
    def start_nodes(self, config: EngineConfig, broadcast: Handle, init_method: str,
                    timeout_s: float) -> None:
        """Wait for every headless node's hello, send each its NodeStart, start watching."""
        deadline = time.monotonic() + timeout_s
        while len(self.nodes) < len(self.expected):
            if time.monotonic() >= deadline:
                missing = sorted(set(self.expected) - set(self.nodes))
                raise WorkerStartupError(
                    f"nodes {missing} did not connect to {self.pc.multinode.master_addr}:"
                    f"{self.port} within {timeout_s:.0f} s: start each with "
                    f"`shardserve serve ... --headless --nnodes {self.pc.multinode.nnodes} "
                    f"--node-rank R --master-addr {self.pc.multinode.master_addr} "
                    f"--master-port {self.pc.multinode.master_port}` "
                    f"and the same SHARDSERVE_CLUSTER_SECRET")
            if self._sock.poll(_POLL_MS):
                self._take_hello(*self._recv())
            self._drain_monitor()  # a node that said hello and left already: failed
            if self.failure is not None:
                raise WorkerStartupError(self.failure)
        for node in self.nodes.values():
            send(self._sock, NodeStart(config, broadcast, init_method, node.ranks), node.identity)
        self._thread = threading.Thread(target=self._watch, name="shardserve-node-watch",
                                        daemon=True)
        self._thread.start()

    def _recv(self) -> tuple[bytes, object, int]:
        """(sender identity, message, the connection's fd). Only peers the CURVE handshake
        admitted get here."""
        frames = self._sock.recv_multipart(copy=False)
        identity, fd = frames[0].bytes, frames[-1].get(zmq.SRCFD)
        try:
            if len(frames) != 2:
                raise ValueError(f"{len(frames)} frames")
            return identity, pickle.loads(frames[1].buffer), fd
        except Exception as e:  # an admitted peer of another version, say: not fatal here
            logger.warning("dropped an unreadable message from %r: %s", identity, e)
            return identity, None, fd

    def _take_hello(self, identity: bytes, msg: object, fd: int) -> None:
        if not isinstance(msg, NodeHello):
            return
        why, pc = None, self.pc
        theirs = (msg.nnodes, msg.world_size, msg.data_parallel_size, msg.replica)
        ours = (pc.multinode.nnodes, pc.world_size, pc.data_parallel_size, self.replica)
        if theirs != ours:
            why = (f"it was started with nnodes={msg.nnodes}, world size {msg.world_size}, "
                   f"data_parallel_size={msg.data_parallel_size} (replica {msg.replica}); node 0 "
                   f"has nnodes={pc.multinode.nnodes}, world size {pc.world_size}, "
                   f"data_parallel_size="
                   f"{pc.data_parallel_size} (replica {self.replica})")
        elif msg.node_rank not in self.expected:
            why = f"node_rank {msg.node_rank} holds none of replica {self.replica}'s ranks"
        elif msg.node_rank in self.nodes and self.nodes[msg.node_rank].identity != identity:
            why = f"node_rank {msg.node_rank} is taken already"
        if why is not None:
            logger.error("refused a node: %s", why)
            send(self._sock, NodeStop(f"node 0 refused this node: {why}"), identity)
            return
        ranks = self.pc.layout.ranks_on_node(msg.node_rank, self.replica)
        self.nodes[msg.node_rank] = _Node(msg.node_rank, identity, msg, ranks, fd=fd)

    def wait_ready(self, timeout_s: float) -> dict[int, Handle]:
        """Every remote rank's reply-queue handle, once every node reported ready."""
        if not self._ready.wait(timeout_s):
            late = [n.rank for n in self.nodes.values() if n.ready is None]
            raise WorkerStartupError(f"nodes {late} did not report ready within {timeout_s:.0f} "
                                     f"s (parallel_config.worker_start_timeout_s)")
        if self.failure is not None:
            raise WorkerStartupError(self.failure)
        return {r: h for n in self.nodes.values() if n.ready
                for r, h in n.ready.reply_handles.items()}

    def wait_failure(self, timeout_s: float) -> str | None:
        """The recorded failure of a node, waiting up to timeout_s for one."""
        deadline = time.monotonic() + timeout_s
        while self.failure is None and time.monotonic() < deadline:
            time.sleep(0.02)
        return self.failure

    # ---- watching (own thread) ----
    def _watch(self) -> None:
        try:
            self._watch_loop()
        except Exception as e:  # noqa: BLE001 - a watch that stops must not go unnoticed
            logger.exception("the node watch failed")
            self._fail(f"the watch over the other nodes failed: {type(e).__name__}: {e}")
        finally:
            self._say_goodbye()

    def _watch_loop(self) -> None:
        next_beat = 0.0
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        while not self._stop.is_set():
            events = dict(poller.poll(_POLL_MS))
            if self._sock in events:
                self._handle(*self._recv())
            if self._monitor in events:
                self._drain_monitor()
            now = time.monotonic()
            if now >= next_beat:
                for node in self.nodes.values():
                    if not node.gone:
                        send(self._sock, Heartbeat(), node.identity)
                next_beat = now + HEARTBEAT_S
            for node in self.nodes.values():
                # Not before it is ready: its agent says nothing while it starts processes.
                if not node.gone and node.ready and now - node.last_seen > NODE_SILENT_S:
                    self._lose(node, f"stopped answering for {NODE_SILENT_S} s")

    def _drain_monitor(self) -> None:
        """A closed connection: the node whose connection it was is gone (a stranger's, or a
        refused node's, names no node)."""
        while self._monitor is not None and self._monitor.poll(0):
            event = recv_monitor_message(self._monitor)
            fd = int(event["value"])
            for node in self.nodes.values():
                if node.fd == fd and not node.gone:
                    self._lose(node, "disconnected (its process tree is gone, or the network)")

    def _lose(self, node: _Node, why: str) -> None:
        node.gone = True
        self._fail(f"{node.describe()} {why}")

    def _handle(self, identity: bytes, msg: object, fd: int) -> None:
        node = next((n for n in self.nodes.values() if n.identity == identity), None)
        if node is None:
            if isinstance(msg, NodeHello):  # a latecomer: every node it could be is here
                self._take_hello(identity, msg, fd)
            return
        node.last_seen = time.monotonic()
        node.fd = fd  # (a reconnection gets a new one)
        if isinstance(msg, NodeBye):
            if not node.gone:
                self._lose(node, "left on its own")
        elif isinstance(msg, NodeFailed):
            self._fail(f"{node.describe()}: {msg.reason}")
        elif isinstance(msg, NodeReady):
            node.ready = msg
            if all(n.ready is not None for n in self.nodes.values()):
                self._ready.set()

    def _fail(self, reason: str) -> None:
        if self._stop.is_set() or self.failure is not None:
            return
        self.failure = reason
        self._ready.set()  # wakes a start-up waiting for readiness
        self._on_failure(reason)

    def _say_goodbye(self) -> None:
        """Tell every live node to stop; wait (bounded) for their byes; close."""
        live = {n.identity: n for n in self.nodes.values() if not n.gone}
        for identity in live:
            send(self._sock, NodeStop("the engine is shutting down"), identity)
        deadline = time.monotonic() + self._grace_s + 3.0
        while live and time.monotonic() < deadline:
            if self._sock.poll(_POLL_MS):
                identity, msg, _ = self._recv()
                if isinstance(msg, NodeBye):
                    live.pop(identity, None)
        if live:
            logger.warning("nodes %s did not confirm their stop", sorted(n.rank for n in
                                                                       live.values()))
        self._close_socket()

    # ---- shutdown ----
    _grace_s = 2.0

    def stop(self, grace_s: float) -> None:
        """Stop the headless nodes (their workers were asked to exit already) and the link."""
        self._grace_s = grace_s
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=grace_s + 10.0)
        elif not self._sock.closed:  # start-up never finished: the socket is still ours
            self._say_goodbye()

    def _close_socket(self) -> None:
        if self._monitor is not None and not self._monitor.closed:
            self._sock.disable_monitor()
            self._monitor.close(linger=0)
        if not self._sock.closed:
            self._sock.close(linger=0)
        release(self._domain)
