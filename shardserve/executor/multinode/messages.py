"""The wire messages of the multi-node link, and its timing.

One authenticated ZMQ connection per headless node and replica, node 0 listening:

    node 0: engine core of replica i                  node R: `shardserve serve --headless`
    ROUTER tcp://master_addr:master_port + i          DEALER, identity b"node-R-<pid>-<random>"
    (CURVE server, ZAP admits the cluster's key)      (CURVE client, keys from the secret)
                                  ◀── NodeHello(node_rank, ip, pid, nnodes, world_size,
                                                data_parallel_size, replica)  once a second
    NodeStart(config, broadcast handle, torch
              init_method, ranks)             ──▶ starts its ranks' worker processes
                                  ◀── NodeReady({rank: reply-queue handle}) | NodeFailed(why)
    Heartbeat every HEARTBEAT_S               ◀─▶ Heartbeat every HEARTBEAT_S
      its connection closed (socket monitor,      node 0 silent master_silent_s() (2 s once the
      matched by fd), or silent node_silent_s()   connection closed) → stop workers; hello
      once ready → node dead (EngineDeadError,    again on a new connection if node 0
      naming the node; a front end that restarts  restarts replicas (NodeStart's config),
      replicas starts the engine core again,      else exit 1
      which waits for a new agent's hello)
                                  ◀── NodeFailed(a worker died)
    NodeStop(reason, final)                   ──▶ stop its workers, NodeBye; exit if final,
                                                  else hello again (a restart is coming)

Frames: each message is one frame, the pickled dataclass. The ROUTER sees the DEALER's identity
in front of it and puts it there to address a node; the DEALER sends and receives the payload
alone:

    DEALER ──[ pickle(message) ]──▶ ROUTER receives [ identity | pickle(message) ]
    ROUTER sends [ identity | pickle(message) ] ──▶ DEALER receives [ pickle(message) ]

They are unpickled only from peers the CURVE handshake admitted (a stranger gets no pipe, so it
sends and receives nothing). The data itself then flows through the MessageQueues: the
broadcast's TCP path to remote ranks, one TCP reply queue per remote rank (their keys travel
inside the handles, over this link).
"""

from __future__ import annotations

from dataclasses import dataclass

from shardserve import envs
from shardserve.config import EngineConfig
from shardserve.ipc import Handle

HEARTBEAT_S = 0.2


def node_silent_s() -> float:
    """Node 0 declares a ready headless node dead after this long without a word (2.5 s)."""
    return envs.node_silent_s()


def master_silent_s() -> float:
    """A headless node gives up on node 0 after this long (5 s): node 0 judges first."""
    return 2 * envs.node_silent_s()


@dataclass(frozen=True)
class NodeHello:
    """Headless → node 0, once a second until NodeStart or NodeStop: what it was started as."""

    node_rank: int
    ip: str  # where this node's reply queues listen
    pid: int
    nnodes: int
    world_size: int
    data_parallel_size: int
    replica: int  # which replica's ranks it offers (it talks to master_port + replica)


@dataclass(frozen=True)
class NodeStart:
    """Node 0 → headless: start these ranks, reading this broadcast."""

    config: EngineConfig
    broadcast: Handle
    init_method: str
    ranks: tuple[int, ...]


@dataclass(frozen=True)
class NodeReady:
    """Headless → node 0: every rank is up; where node 0 reads each one's replies."""

    reply_handles: dict[int, Handle]


@dataclass(frozen=True)
class NodeFailed:
    """Headless → node 0: a rank could not start or died; the node stops."""

    reason: str


@dataclass(frozen=True)
class Heartbeat:
    """Both ways, every HEARTBEAT_S: still here."""


@dataclass(frozen=True)
class NodeStop:
    """Node 0 → headless: refused (at the hello) or the replica's engine core is stopping.
    `final`: node 0 will not start this replica again (a refusal, the server's or LLM's
    shutdown, or restarts off); not final: its engine failed and the front end restarts it,
    so the agent waits for the restarted one (headless.py)."""

    reason: str = ""
    final: bool = True


@dataclass(frozen=True)
class NodeBye:
    """Headless → node 0: its workers stopped after a NodeStop (or it leaves on its own)."""
