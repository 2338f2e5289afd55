"""Node 0's side of the multi-node link (RemoteNodes): gathers the headless nodes that hold an
engine core's ranks, starts them, watches them; messages.py has the exchange."""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq
from zmq.utils.monitor import recv_monitor_message

from shardserve.config import EngineConfig, ParallelConfig
from shardserve.errors import WorkerStartupError
from shardserve.executor.multinode.messages import (
    HEARTBEAT_S,
    Heartbeat,
    NodeBye,
    NodeFailed,
    NodeHello,
    NodeReady,
    NodeStart,
    NodeStop,
    node_silent_s,
)
from shardserve.executor.multinode.secret import link_keys
from shardserve.executor.multinode.sockets import POLL_MS, link_port, recv_routed, send
from shardserve.ipc import Handle
from shardserve.ipc.curve_auth import release, secure_server

logger = logging.getLogger(__name__)
_DRAIN_MAX = 256  # messages read per turn of the watch loop (strangers cannot flood it)


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
    """Node 0's side of the link of one engine core (replica), keyed by the cluster `secret`.

    The socket belongs to the calling thread until `start_nodes` returns, then to the watch
    thread alone (ZMQ sockets are not thread-safe); `stop` asks that thread to finish.
    """

    def __init__(self, pc: ParallelConfig, secret: str,
                 on_failure: Callable[[str], None]) -> None:
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
        self._grace_s = 2.0  # the workers' time to stop, once `stop` says it
        self._final = True  # the NodeStop that `stop` sends: no restart of this replica follows
        # Unique per socket: a restarted replica listens on the same port, and its predecessor's
        # watch thread (joined with a bound) may release its domain after this one admitted the
        # nodes' key under the same name, refusing every node from then on (seen in the suite).
        self._domain = f"shardserve-nodes-{os.getpid()}-{self.port}-{secrets.token_hex(4)}"
        addr = pc.multinode.master_addr
        if addr.startswith("127.") or addr in ("localhost", "::1"):
            logger.warning("nnodes=%d with master_addr=%s: only processes on this machine can "
                           "join; give --master-addr this machine's address on the network the "
                           "other nodes share", pc.multinode.nnodes, addr)
        self._sock = zmq.Context.instance().socket(zmq.ROUTER)
        self._monitor: zmq.Socket | None = None
        self._listen(secret)

    def _listen(self, secret: str) -> None:
        addr = self.pc.multinode.master_addr
        try:
            secure_server(self._sock, link_keys(secret), self._domain)
            self._sock.setsockopt(zmq.LINGER, 0)
            self._monitor = self._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
            self._sock.bind(f"tcp://{addr}:{self.port}")
        except zmq.ZMQError as e:
            self._close_socket()
            raise RuntimeError(f"cannot listen for the other nodes on {addr}:{self.port} ({e}); "
                               f"choose another --master-port (replica i listens on "
                               f"master_port + i)") from e

    # ---- start-up (calling thread) ----
    def start_nodes(self, config: EngineConfig, broadcast: Handle, init_method: str,
                    timeout_s: float) -> None:
        """Wait for every headless node's hello and send each its NodeStart; `watch` next."""
        deadline = time.monotonic() + timeout_s
        while len(self.nodes) < len(self.expected):
            if time.monotonic() >= deadline:
                raise WorkerStartupError(self._not_connected(timeout_s))
            if self._sock.poll(POLL_MS):
                self._take_hello(*recv_routed(self._sock))
            self._drain_monitor()  # a node that said hello and left already: failed
            if self.failure is not None:
                raise WorkerStartupError(self.failure)
        for node in self.nodes.values():
            send(self._sock, NodeStart(config, broadcast, init_method, node.ranks), node.identity)

    def watch(self) -> None:
        """From here on the link is served on a thread of its own. Called after this node's
        workers have started: a Python thread of ours running at fork time would make them
        start with spawn (executor/start_method.py), a fresh interpreter each."""
        self._thread = threading.Thread(target=self._watch, name="shardserve-node-watch",
                                        daemon=True)
        self._thread.start()

    def _not_connected(self, timeout_s: float) -> str:
        mn = self.pc.multinode
        missing = sorted(set(self.expected) - set(self.nodes))
        return (f"nodes {missing} did not connect to {mn.master_addr}:{self.port} within "
                f"{timeout_s:.0f} s: start each with `shardserve serve ... --headless --nnodes "
                f"{mn.nnodes} --node-rank R --master-addr {mn.master_addr} --master-port "
                f"{mn.master_port}` and the same SHARDSERVE_CLUSTER_SECRET")

    def _take_hello(self, identity: bytes, msg: object, fd: int) -> None:
        if not isinstance(msg, NodeHello):
            return
        why = self._refusal(identity, msg)
        if why is not None:
            logger.error("refused a node: %s", why)
            send(self._sock, NodeStop(f"node 0 refused this node: {why}"), identity)
            return
        ranks = self.pc.layout.ranks_on_node(msg.node_rank, self.replica)
        self.nodes[msg.node_rank] = _Node(msg.node_rank, identity, msg, ranks, fd=fd)

    def _refusal(self, identity: bytes, msg: NodeHello) -> str | None:
        """Why node 0 refuses this hello (None: it is one of ours)."""
        pc = self.pc
        theirs = (msg.nnodes, msg.world_size, msg.data_parallel_size, msg.replica)
        ours = (pc.multinode.nnodes, pc.world_size, pc.data_parallel_size, self.replica)
        if theirs != ours:
            return (f"it was started with nnodes={msg.nnodes}, world size {msg.world_size}, "
                    f"data_parallel_size={msg.data_parallel_size} (replica {msg.replica}); "
                    f"node 0 has nnodes={pc.multinode.nnodes}, world size {pc.world_size}, "
                    f"data_parallel_size={pc.data_parallel_size} (replica {self.replica})")
        if msg.node_rank not in self.expected:
            return f"node_rank {msg.node_rank} holds none of replica {self.replica}'s ranks"
        if msg.node_rank in self.nodes and self.nodes[msg.node_rank].identity != identity:
            return f"node_rank {msg.node_rank} is taken already"
        return None

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
        silent_s = node_silent_s()
        while not self._stop.is_set():
            events = dict(poller.poll(POLL_MS))
            if self._sock in events:
                self._drain_socket()
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
                if not node.gone and node.ready and now - node.last_seen > silent_s:
                    self._lose(node, f"stopped answering for {silent_s} s")

    def _drain_socket(self) -> None:
        """Every message already queued (a bounded number), before any silence is judged: a
        watch thread that was itself held up would else judge a node by the one message it
        read while the node's heartbeats wait behind it."""
        for _ in range(_DRAIN_MAX):
            self._handle(*recv_routed(self._sock))
            if not self._sock.poll(0):
                return

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
                known = self.nodes.get(msg.node_rank)
                if known is not None and known.gone:
                    return  # its lost node's new agent: the restarted engine core takes it
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
        why = ("the engine is shutting down" if self._final else
               f"replica {self.replica}'s engine failed; the front end restarts it")
        for identity in live:
            send(self._sock, NodeStop(why, final=self._final), identity)
        deadline = time.monotonic() + self._grace_s + 3.0
        while live and time.monotonic() < deadline:
            if self._sock.poll(POLL_MS):
                identity, msg, _ = recv_routed(self._sock)
                if isinstance(msg, NodeBye):
                    live.pop(identity, None)
        if live:
            logger.warning("nodes %s did not confirm their stop",
                           sorted(n.rank for n in live.values()))
        self._close_socket()

    # ---- shutdown ----
    def stop(self, grace_s: float, final: bool = True) -> None:
        """Stop the headless nodes (their workers were asked to exit already) and the link.
        `final`: no restart of this replica follows (the nodes' agents exit); else they wait
        for the restarted replica's engine core (messages.NodeStop)."""
        self._grace_s = grace_s
        self._final = final
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
