"""MultiprocExecutor: one worker process per rank, fed by the shared-memory broadcast queue.

    collective_rpc ──RpcRequest──▶ broadcast MessageQueue (1 → world_size) ──▶ rank busy loops
    QueueRpc      ◀──RpcReply──── one reply MessageQueue per rank ◀────────────────┘

The queues, the call/reply bookkeeping and the close order live in queue_rpc.py, shared with
ray_v2; this class supplies the processes and their death watch (worker_process.py: start-up,
death watch, staged stop).

With nnodes > 1 this is node 0: ranks are node-major, so its own ranks 0..L-1 are the
broadcast's shared-memory readers and every other node's ranks read over the queue's TCP path
and reply through TCP queues. RemoteNodes (multinode/remote_nodes.py) starts the other nodes'
ranks through their `--headless` agents (multinode/headless.py) and reports a lost node as this
executor's failure. A front end that restarts dead replicas starts this executor again: it
waits for the nodes' agents (the ones that survived, or new ones) within the restart's bound
(`_node_wait_s`), and its stop tells the agents whether a restart follows (`_stop_is_final`).
"""

from __future__ import annotations

import datetime
import logging
import os
import shutil
import signal
import tempfile
from multiprocessing.connection import wait
from typing import Any

import psutil
import torch.distributed as dist

from shardserve.distributed.parallel_state import STORE_CLIENT_SCHEME
from shardserve.errors import WorkerStartupError
from shardserve.executor.abstract import Executor
from shardserve.executor.multinode.remote_nodes import RemoteNodes
from shardserve.executor.multinode.secret import cluster_secret
from shardserve.executor.queue_rpc import QueueRpc, WorkerHooks
from shardserve.executor.worker_process import (
    WorkerHandle,
    WorkerMonitor,
    start_workers,
    stop_workers,
    wait_for_ready,
)
from shardserve.ipc.segments import unlink_segments_of

logger = logging.getLogger(__name__)

# With replica restarts on, the wait for the other nodes ends this long before the front end's
# bound on a restart: the engine core's start before it, and its error's way to the front end.
_RESTART_MARGIN_S = 10.0


class MultiprocExecutor(Executor):

    def _init_executor(self) -> None:
        pc = self.parallel_config
        if pc.multinode.node_rank != 0:
            raise ValueError(f"node_rank={pc.multinode.node_rank} runs only workers: start that "
                             f"node with "
                             f"`shardserve serve MODEL --headless --nnodes {pc.multinode.nnodes} "
                             f"--node-rank {pc.multinode.node_rank} ...`")
        self.world_size = pc.world_size
        self.workers: list[WorkerHandle] = []
        self.monitor: WorkerMonitor | None = None
        self.remote: RemoteNodes | None = None
        self._store: dist.TCPStore | None = None
        self.store_port = 0  # across nodes: torch's store (closed once all ready)
        self._tmpdir = tempfile.mkdtemp(prefix="shardserve-dist-")
        # Node-major ranks: node 0's are the broadcast's shared-memory readers 0..L-1, the
        # other nodes' read over its TCP path.
        # A prefix: 0..L-1 (maybe none).
        self.local_ranks = list(pc.layout.ranks_on_node(0, pc.data_parallel_rank))
        self.rpc = self._queue_rpc()
        try:
            if self._spans_nodes:
                self.remote = RemoteNodes(pc, cluster_secret(self.config), self._on_node_failure)
            self._start(pc.worker_start_timeout_s)
        except BaseException as e:
            self.shutdown()
            failure = self.remote.failure if self.remote is not None else None
            if failure is not None and isinstance(e, Exception) and str(e) != failure:
                raise WorkerStartupError(failure) from e  # the cause, not its consequences
            raise

    @property
    def _spans_nodes(self) -> bool:
        return len(self.local_ranks) < self.world_size

    def _queue_rpc(self) -> QueueRpc:
        """Node 0's ranks read the broadcast through shared memory, the others over TCP."""
        hooks = WorkerHooks(
            self._raise_if_dead, lambda: self._death, self._dead_worker, self._unusual_workers
        )
        ip = self.parallel_config.multinode.master_addr if self._spans_nodes else None
        return QueueRpc(self.world_size, len(self.local_ranks), ip, hooks)

    def _start(self, timeout_s: float) -> None:
        pc = self.parallel_config
        # The file store needs no port, so nothing can take it between choosing and binding.
        # Across nodes, a TCP store served here, on a port the OS picks: this replica's rank 0
        # may run on another node, and torch's tcp:// would have rank 0 serve it there.
        init_method = f"file://{self._tmpdir}/store"
        if self.remote is not None:
            self._store = dist.TCPStore(pc.multinode.master_addr, 0, is_master=True,
                                        wait_for_workers=False,
                                        timeout=datetime.timedelta(seconds=timeout_s))
            self.store_port = self._store.port
            init_method = f"{STORE_CLIENT_SCHEME}{pc.multinode.master_addr}:{self._store.port}"
        broadcast = self.rpc.broadcast.export_handle()
        if self.remote is not None:
            self.remote.start_nodes(self.config, broadcast, init_method,
                                    self._node_wait_s(timeout_s))
        # Appended to as each starts, so that a failure or signal part-way stops those too.
        start_workers(self.config, broadcast, init_method,
                      ranks=self.local_ranks, into=self.workers,
                      local_ranks=[pc.layout.local_rank_of(r, pc.data_parallel_rank)
                                   for r in self.local_ranks])
        if self.remote is not None:  # only now: its thread would rule out forking the workers
            self.remote.watch()
        self._check_nodes()
        wait_for_ready(self.workers, timeout_s)
        replies = [h.reply_handle for h in self.workers]
        if self.remote is not None:
            remote = self.remote.wait_ready(timeout_s)
            replies += [remote[r] for r in range(len(self.local_ranks), self.world_size)]
        self.rpc.connect(replies, timeout_s,
                         abort=lambda: self.remote.failure if self.remote else None)
        self.monitor = WorkerMonitor(self.workers, self._on_worker_death)
        self._check_nodes()
        if self.config.device_config.device == "cpu":
            # Every rank is READY: gloo has connected its pairs and built every group, and
            # needs the store no more (NCCL makes communicators lazily, through it). Closed,
            # its unauthenticated port serves nobody.
            self._store = None

    def _node_wait_s(self, timeout_s: float) -> float:
        """How long to wait for the other nodes' agents: worker_start_timeout_s; with replica
        restarts on (this may be a restart, after a node was lost), also short enough that a
        node whose agent does not come back fails the restart with this executor's error,
        which names the command that starts the agent, before the front end's bound on the
        restart (engine_restart_timeout_s) ends it without a word. (The executor cannot tell a
        restart from the first start, whose bound is longer: the cap holds for both.)"""
        bound = self.config.recovery_config.engine_restart_timeout_s
        if self.config.recovery_config.restarts == 0:
            return timeout_s
        return min(timeout_s, max(bound - _RESTART_MARGIN_S, bound / 2))

    def _stop_is_final(self) -> bool:
        """Is this replica stopped for good (the other nodes' agents exit)? With restarts off,
        or a started, healthy engine told to shut down (the server's or LLM's shutdown). Not:
        a failed executor (a worker or node died, a step failed) or a start that did not
        finish, which the front end restarts (the agents wait for it)."""
        if self.config.recovery_config.restarts == 0:
            return True
        return self.monitor is not None and not self.is_failed

    def _check_nodes(self) -> None:
        if self.remote is not None and self.remote.failure is not None:
            raise WorkerStartupError(self.remote.failure)

    def _on_node_failure(self, reason: str) -> None:
        if self.monitor is None:
            # Still starting: our ranks may wait inside torch's rendezvous (a C call that a
            # SIGTERM would not interrupt) for ranks that will never come: end them, so that
            # start-up fails now (_start reports the node's failure, not their deaths).
            for h in list(self.workers):
                if h.process.is_alive():
                    os.kill(h.pid, signal.SIGKILL)
        self._mark_failed(reason)

    # ---- failure ----
    def _on_worker_death(self, handle: WorkerHandle) -> None:
        self._mark_failed(
            f"worker {self.parallel_config.describe_rank(handle.rank, f'pid {handle.pid}')} "
            f"died unexpectedly ({handle.describe_exit()})"
        )

    def collective_rpc(self, *args: Any, **kwargs: Any) -> Any:  # see Executor
        return self.rpc.call(*args, **kwargs)

    def _dead_worker(self, wait_s: float) -> str | None:
        """A description of a worker that has exited (waiting up to wait_s for one), or None."""
        if self.remote is not None and self.remote.failure is not None:
            return self.remote.failure
        sentinels = {h.process.sentinel: h for h in self.workers}
        ready = wait(list(sentinels), timeout=wait_s)
        if not ready:
            # A remote rank's broken collective: its node's disconnect arrives within moments.
            return self.remote.wait_failure(1.0) if self.remote is not None else None
        h = sentinels[ready[0]]
        h.process.join(timeout=1)
        who = self.parallel_config.describe_rank(h.rank, f"pid {h.pid}")
        return f"worker {who} died unexpectedly ({h.describe_exit()})"

    def _unusual_workers(self) -> str:
        """Workers that are not running or waiting (stopped, zombie...), for timeout messages:
        the rank that blocks a collective is often not the one whose reply is missing."""
        notes = []
        for h in self.workers:
            try:
                status = psutil.Process(h.pid).status()
            except psutil.Error:
                status = "gone"
            if status not in (
                psutil.STATUS_RUNNING,
                psutil.STATUS_SLEEPING,
                psutil.STATUS_DISK_SLEEP,
            ):
                notes.append(f"rank {h.rank} (pid {h.pid}) is {status}")
        return f"; {', '.join(notes)}" if notes else ""

    # ---- shutdown (Executor.shutdown: once, under its lock) ----
    def _shutdown(self) -> None:
        if self.monitor is not None:
            self.monitor.stop()  # the deaths to come are ours
        self.rpc.shutdown(self._stop_processes)
        for h in self.workers:  # what a killed worker could not unlink (e.g. all-reduce)
            if not h.process.is_alive():
                unlink_segments_of(h.pid)
        shutil.rmtree(self._tmpdir, ignore_errors=True)
        self._store = None  # stops its server

    def _stop_processes(self, grace_s: float) -> None:
        stop_workers(self.workers, grace_s)
        if self.remote is not None:
            self.remote.stop(grace_s, final=self._stop_is_final())
