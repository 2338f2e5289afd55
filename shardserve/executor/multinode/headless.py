"""A headless node of the multi-node mp backend: runs this machine's ranks, nothing else.

    `shardserve serve MODEL --headless --nnodes N --node-rank R --master-addr A --master-port P`

    1. connect to node 0 (CURVE keys from the cluster secret, secret.py) and say hello once a
       second until node 0 answers with NodeStart (bounded by worker_start_timeout_s, so a node
       started long before node 0 does not wait for ever);
    2. start this node's ranks (worker_process.start_workers: the same worker processes as on
       node 0, replying over TCP) and report NodeReady with their reply-queue handles;
    3. watch: heartbeats both ways; a worker that dies is reported (NodeFailed); node 0 silent
       for master_silent_s() (2 s once its connection closed) ends the replica's life here; so
       does NodeStop, after the workers exit (NodeBye).
    4. after the end of one life of the replica (its engine core on node 0 failed, was stopped
       or vanished): if node 0 restarts dead replicas (its config's max_engine_restarts > 0,
       as `shardserve serve` does by default) and did not say that this stop is final, stop
       this node's workers and go back to 1 on a fresh connection (a new identity: nothing of
       the old link reaches the new engine core), waiting at most worker_start_timeout_s for
       the restarted replica; else exit: 0 after a final NodeStop (the server or LLM shut
       down), 1 otherwise.
A node that was lost (its agent killed, its machine gone) comes back as a new agent that the
operator or a supervisor starts with the same command: the restarted engine core waits for it
(multiproc.py: bounded by worker_start_timeout_s and engine_restart_timeout_s).

With data parallelism, one such link per replica that has ranks here (node 0 runs every
engine core; replica i's listens on master_port + i). Every way out stops the workers (staged:
wait, SIGTERM, SIGKILL); killed outright, the workers notice by their death pipe and exit.
messages.py has the exchange.
"""

from __future__ import annotations

import logging
import os
import pickle
import threading
import time

import zmq
from zmq.utils.monitor import recv_monitor_message

from shardserve.config import ParallelConfig
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
    master_silent_s,
)
from shardserve.executor.multinode.secret import headless_secret, link_keys
from shardserve.executor.multinode.sockets import POLL_MS, client_socket, link_port, send
from shardserve.executor.worker_process import (
    WorkerHandle,
    start_workers,
    stop_workers,
    take_ready_message,
)
from shardserve.ipc.curve_auth import CurveKeys
from shardserve.ipc.host_address import reachable_ip
from shardserve.ipc.segments import unlink_segments_of

logger = logging.getLogger(__name__)

_STOP_GRACE_S = 2.0
# After a rank failed here (reported), how long node 0 has to stop the replica (NodeStop)
# before this node gives up on that life of it by itself.
_FAILED_WAIT_S = 30.0
AGAIN = -1  # a life's end after which the replica may come back: wait for it again
_HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                     | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
# A refused handshake that libzmq has not retried with success within this long gets a fresh
# connection (see _await_start).
_REFUSED_RETRY_S = 2.0


def run_headless(pc: ParallelConfig) -> int:
    """Serve this node's ranks of every replica that has some here (one link each, on threads
    of their own); the worst exit status of them."""
    if pc.multinode.nnodes < 2 or pc.multinode.node_rank == 0:
        raise ValueError(f"--headless runs a node other than node 0: give --nnodes >= 2 and "
                         f"--node-rank in 1..nnodes-1 (got nnodes={pc.multinode.nnodes}, "
                         f"node_rank={pc.multinode.node_rank})")
    secret = headless_secret(pc)
    replicas = [i for i in range(pc.data_parallel_size)
                if pc.layout.ranks_on_node(pc.multinode.node_rank, i)]
    nodes = [HeadlessNode(pc, i, secret) for i in replicas]
    logger.info("node %d: waiting for node 0 at %s:%d (replicas %s)", pc.multinode.node_rank,
                pc.multinode.master_addr, pc.multinode.master_port, replicas)
    if len(nodes) == 1:
        return nodes[0].run()
    codes: dict[int, int] = {}
    threads = [threading.Thread(target=lambda n=n: codes.__setitem__(n.replica, n.run()),
                                name=f"replica-{n.replica}") for n in nodes]
    for t in threads:
        t.start()
    try:
        while any(t.is_alive() for t in threads):  # each ends by itself: a final NodeStop,
            for t in threads:                       # node 0 gone for good, or a failure
                t.join(timeout=0.2)
    finally:  # SIGTERM or Ctrl-C lands on this thread: the others stop their workers too
        for n in nodes:
            n.stopping.set()
        for t in threads:
            t.join(timeout=30)
    return max(codes.values(), default=1)


class HeadlessNode:
    """This node's share of one replica's ranks, and the link to that replica's engine core,
    keyed by the cluster `secret`; through every life of the replica (node 0 restarts a dead
    one at the same index, listening on the same port)."""

    def __init__(self, pc: ParallelConfig, replica: int, secret: str) -> None:
        self.pc = pc
        self.replica = replica
        # Where node 0 can reach this node's reply queues: our end of the route to it.
        self.ip = reachable_ip((pc.multinode.master_addr, pc.multinode.master_port))
        self._keys: CurveKeys = link_keys(secret)
        self.workers: list[WorkerHandle] = []
        self.stopping = threading.Event()  # set from another thread: stop now (status 1)
        self.lives = 0  # the replica's lives this node served (started ranks for)
        # Does node 0 restart a dead replica? (its config, in NodeStart; until then: no)
        self._restarts = False
        self._open()

    def _open(self) -> None:
        """A fresh connection to node 0 (a new identity: a restarted engine core sees a new
        node, and nothing queued for or from the old one)."""
        self.sock = client_socket(self.pc, self.replica, self._keys)
        self._last_heard = time.monotonic()
        self._next_beat = 0.0
        # A closed connection to node 0 shortens the patience: silence after it means node 0
        # (not a slow network) is gone.
        self._monitor = self.sock.get_monitor_socket(
            zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED | _HANDSHAKE_FAILED)
        self._master_silent_s = master_silent_s()  # read once: the limit a closed link shortens
        self._silent_limit = self._master_silent_s

    def _send(self, message: object) -> bool:
        """Queue a message for node 0; False where the socket has no connection to queue it
        on (its handshake was refused and libzmq dropped it: the agent once died here of
        zmq.Again). Node 0 then hears nothing, which its bounds and ours already handle."""
        try:
            send(self.sock, message)
            return True
        except zmq.Again:
            return False

    def _events(self) -> list[int]:
        """The monitor's events since the last look, in order."""
        events = []
        while self._monitor.poll(0):
            events.append(recv_monitor_message(self._monitor)["event"])
        return events

    def _close(self) -> None:
        if self.sock.closed:
            return
        self.sock.disable_monitor()
        self._monitor.close(linger=0)
        self.sock.close(linger=1000)  # a NodeBye still queued gets out

    def run(self) -> int:
        """Serve every life of the replica until node 0 stops us for good (0), or something
        fails, or node 0 does not (re)start the replica in time (1)."""
        try:
            while True:
                code = self._life()
                if code != AGAIN or self.stopping.is_set():
                    return 1 if code == AGAIN else code
                self._close()
                self._open()
                logger.warning("node %d: waiting for node 0 to start replica %d again (at "
                               "most %.0f s: worker_start_timeout_s)", self.pc.multinode.node_rank,
                               self.replica, self.pc.worker_start_timeout_s)
        finally:
            self._stop_workers(0.0)
            self._close()

    def _life(self) -> int:
        """One life of the replica here: its NodeStart, our ranks, serving them; the exit
        status, or AGAIN."""
        start = self._await_start()
        if start is None:
            return 1
        self.lives += 1
        self._restarts = start.config.recovery_config.restarts > 0
        logger.info("node %d: starting replica %d's ranks %s", self.pc.multinode.node_rank,
                    self.replica, list(start.ranks))
        pc = start.config.parallel_config
        try:
            start_workers(start.config, start.broadcast, start.init_method,
                          ranks=list(start.ranks), reply_ip=self.ip, into=self.workers,
                          local_ranks=[pc.layout.local_rank_of(r, self.replica)
                                       for r in start.ranks])
            return self._serve()
        finally:
            self._stop_workers(0.0)  # (after NodeStop they have stopped already)

    def _stop_workers(self, grace_s: float) -> None:
        stop_workers(self.workers, grace_s)
        for h in self.workers:  # what a killed worker could not unlink (e.g. all-reduce)
            if not h.process.is_alive():
                unlink_segments_of(h.pid)
        self.workers = []

    def _await_start(self) -> NodeStart | None:
        pc = self.pc
        hello = NodeHello(pc.multinode.node_rank, self.ip, os.getpid(), pc.multinode.nnodes,
                          pc.world_size, pc.data_parallel_size, self.replica)
        deadline = time.monotonic() + pc.worker_start_timeout_s
        next_hello = 0.0
        refused_at: float | None = None
        while time.monotonic() < deadline and not self.stopping.is_set():
            if time.monotonic() >= next_hello:
                if not self._send(hello):  # no connection to queue it on: refused (below)
                    refused_at = refused_at or time.monotonic()
                next_hello = time.monotonic() + 1.0
            for event in self._events():
                if event & _HANDSHAKE_FAILED:
                    refused_at = refused_at or time.monotonic()
                elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    refused_at = None
            if refused_at is not None and time.monotonic() - refused_at > _REFUSED_RETRY_S:
                # libzmq may never retry a connection whose handshake was refused
                # (zeromq/libzmq#3519): here the restarted replica's predecessor, its port
                # still open a moment after its close, refused us; a wrong secret is refused
                # again. A fresh connection tries again either way.
                self._close()
                self._open()
                refused_at, next_hello = None, 0.0
                continue
            msg = self._poll()
            if isinstance(msg, NodeStart):
                return msg
            if isinstance(msg, NodeStop):
                logger.error("%s", msg.reason)
                return None
        if self.stopping.is_set():
            return None
        logger.error("node 0 (%s:%d) did not %s within %.0f s (worker_start_timeout_s); is "
                     "it running, with the same SHARDSERVE_CLUSTER_SECRET?",
                     pc.multinode.master_addr, link_port(pc, self.replica),
                     "start the replica again" if self.lives else "answer",
                     pc.worker_start_timeout_s)
        return None

    def _poll(self) -> object | None:
        if not self.sock.poll(POLL_MS):
            return None
        # Only node 0, which proved the cluster's key in the CURVE handshake, can reach us.
        msg = pickle.loads(self.sock.recv())
        self._last_heard = time.monotonic()
        return msg

    def _serve(self) -> int:
        pending = list(self.workers)
        failed_at: float | None = None  # a rank here failed (reported): node 0 stops us next
        self._events()  # closes before the start (refused attempts): not news
        while not self.stopping.is_set():
            msg = self._poll()
            if isinstance(msg, NodeStop):
                return self._stop_as_asked(msg)
            now = time.monotonic()
            if self._node_0_gone(now):
                return AGAIN if self._restarts else 1
            if failed_at is not None:
                if now - failed_at > _FAILED_WAIT_S:
                    logger.error("node 0 did not stop replica %d within %.0f s of its failure "
                                 "here", self.replica, _FAILED_WAIT_S)
                    return AGAIN if self._restarts else 1
                continue
            if pending:
                pending = self._collect_ready(pending)
                failed = pending is None
            elif (dead := self._failed_worker()) is not None:
                self._report(f"worker rank {dead.rank} (pid {dead.pid}) died unexpectedly "
                             f"({dead.describe_exit()})")
                failed = True
            else:
                failed = False
            if failed:
                if not self._restarts:
                    return 1
                # Node 0 restarts the replica: our other ranks are no use to this life; its
                # NodeStop (non-final) then ends it, and we wait for the next.
                self._stop_workers(0.0)
                pending, failed_at = [], time.monotonic()
        return 1  # told to stop from another thread (SIGTERM, Ctrl-C)

    def _stop_as_asked(self, msg: NodeStop) -> int:
        logger.info("node %d: node 0 asked us to stop (%s)", self.pc.multinode.node_rank,
                    msg.reason)
        self._stop_workers(_STOP_GRACE_S)
        self._send(NodeBye())  # after the workers: node 0 waits for it to close the link
        return 0 if msg.final else AGAIN

    def _node_0_gone(self, now: float) -> bool:
        """Send our heartbeat when due; is node 0 silent past its limit (which a closed
        connection shortens)?"""
        if now >= self._next_beat:
            self._send(Heartbeat())
            self._next_beat = now + HEARTBEAT_S
        if zmq.EVENT_DISCONNECTED in self._events():
            self._silent_limit = min(self._silent_limit, now - self._last_heard + 2.0)
        if now - self._last_heard <= self._silent_limit:
            return False
        logger.error("node 0 (%s:%d) is gone (silent for %.1f s%s); stopping this node's "
                     "workers", self.pc.multinode.master_addr, link_port(self.pc, self.replica),
                     now - self._last_heard, ", its connection closed"
                     if self._silent_limit < self._master_silent_s else "")
        return True

    def _failed_worker(self) -> WorkerHandle | None:
        """A worker that exited other than by the engine's shutdown request (exit code 0: the
        broadcast's SHUTDOWN reaches our workers just before node 0's NodeStop reaches us)."""
        for h in self.workers:
            if not h.process.is_alive():
                h.process.join(timeout=1)
                if h.process.exitcode != 0:
                    return h
        return None

    def _collect_ready(self, pending: list[WorkerHandle]) -> list[WorkerHandle] | None:
        """Take the READY of workers that sent it; report NodeReady when all have."""
        still = []
        for h in pending:
            if h.ready_conn.poll(0) or not h.process.is_alive():
                try:
                    take_ready_message(h)
                except WorkerStartupError as e:
                    self._report(str(e))
                    return None
            else:
                still.append(h)
        if not still:
            handles = {h.rank: h.reply_handle for h in self.workers}
            self._send(NodeReady(handles))
            logger.info("node %d: ranks %s ready", self.pc.multinode.node_rank, sorted(handles))
        return still

    def _report(self, reason: str) -> None:
        logger.error("%s", reason)
        try:
            self._send(NodeFailed(reason))
        except zmq.ZMQError:
            pass
