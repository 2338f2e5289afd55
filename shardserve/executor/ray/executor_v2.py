"""RayExecutorV2 (`ray_v2`): Ray places and supervises the workers; shardserve moves the data.

    RayWorkerGroup (worker_group.py): placement group, one actor per rank, init_worker
    collective_rpc ──RpcRequest──▶ broadcast MessageQueue ──▶ actor.run(): run_busy_loop
                                   ranks on the driver's node: shared memory (0..n_local-1)
                                   ranks on other nodes: TCP
    QueueRpc       ◀──RpcReply─── one reply MessageQueue per rank (shm or TCP, likewise)

The queues, the RPC bookkeeping and the close order are the mp backend's (executor/queue_rpc.py);
Ray only hosts the processes. Each actor's run() call lasts as long as its busy loop, so its ref
finishing is the death signal.
"""

from __future__ import annotations

import logging
from typing import Any

import ray

from shardserve.executor.abstract import Executor
from shardserve.executor.queue_rpc import QueueRpc, WorkerHooks
from shardserve.executor.ray.worker_group import RayWorkerGroup

logger = logging.getLogger(__name__)

class RayExecutorV2(Executor):
    uses_ray = True

    def _init_executor(self) -> None:
        pc = self.parallel_config
        self.world_size = pc.world_size
        self.rpc: QueueRpc | None = None
        self._runs: list[Any] = []  # each actor's run() call: ends with its busy loop
        self.group = RayWorkerGroup(self.config, self._mark_failed)
        try:
            self.group.start(pc.worker_start_timeout_s)
            self._connect_queues(pc.worker_start_timeout_s)
        except BaseException:
            self.shutdown()
            raise

    def _connect_queues(self, timeout_s: float) -> None:
        placement, actors = self.group.placement, self.group.actors
        assert placement is not None
        # Invariant of place_ranks: the driver node's ranks come first, so "local reader"
        # (rank < n_local_reader in MessageQueue) means "on the driver's node".
        n_local = len(placement.ranks_on(placement.driver_node))
        assert all(n == placement.driver_node for n in placement.nodes[:n_local])
        hooks = WorkerHooks(self._raise_if_dead, lambda: self._death, self._find_dead)
        # Ray's address of this node is routable in-cluster.
        self.rpc = QueueRpc(self.world_size, n_local, ray.util.get_node_ip_address(), hooks)
        handle = self.rpc.broadcast.export_handle()
        reply_handles = ray.get(
            [a.open_reply_queue.remote(handle, r < n_local) for r, a in enumerate(actors)],
            timeout=timeout_s,
        )
        # Ordering: run() must be under way before we wait on the broadcast queue, since each
        # worker attaches to it inside run().
        runs = {a.run.remote(): r for r, a in enumerate(actors)}
        self.group.watch({**runs, **self.group.lifelines})
        self._runs = list(runs)
        self.rpc.connect(reply_handles, timeout_s)

    # ---- failure ----
    def _find_dead(self, wait_s: float) -> str | None:
        if self._death is None:
            self.group.report_dead(wait_s)
        return self._death

    def collective_rpc(self, *args: Any, **kwargs: Any) -> Any:  # see Executor
        assert self.rpc is not None  # set once the workers are placed, before any call
        return self.rpc.call(*args, **kwargs)

    # ---- shutdown (Executor.shutdown: once, under its lock) ----
    def _shutdown(self) -> None:
        self.group.stop_watching()  # the deaths to come are ours
        if self.rpc is None:  # not placed: nothing reads a queue
            self._stop_actors(0.0)
        else:  # a dead rank reads no request: then the actors go at once
            self.rpc.shutdown(self._stop_actors, ask=self._death is None)

    def _stop_actors(self, grace_s: float) -> None:
        self.group.stop(grace_s, graceful=self._runs)
