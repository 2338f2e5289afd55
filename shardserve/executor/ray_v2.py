"""RayExecutorV2 (`ray_v2`): Ray places and supervises the workers; shardserve moves the data.

    RayWorkerGroup (ray_workers.py): placement group, one actor per rank, init_worker
    collective_rpc ──RpcRequest──▶ broadcast MessageQueue ──▶ actor.run(): run_busy_loop
                                   ranks on the driver's node: shared memory (0..n_local-1)
                                   ranks on other nodes: TCP
    RpcChannel     ◀──RpcReply─── one reply MessageQueue per rank (shm or TCP, likewise)

The queues and the RPC bookkeeping are the mp backend's (queue_rpc.py, rpc_channel.py); Ray only
hosts the processes. Each actor's run() call lasts as long as its busy loop, so its ref
finishing is the death signal.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import ray

from shardserve.executor.abstract import Executor
from shardserve.executor.queue_rpc import QueueRpc
from shardserve.executor.ray_workers import RayWorkerGroup
from shardserve.executor.rpc_channel import WorkerHooks
from shardserve.ipc import MessageQueueWriter

logger = logging.getLogger(__name__)

_SHUTDOWN_GRACE_S = 2.0


class RayExecutorV2(Executor):
    uses_ray = True

    def _init_executor(self) -> None:
        pc = self.parallel_config
        self.world_size = pc.world_size
        self._shutdown_lock = threading.Lock()
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
        self.rpc = QueueRpc(
            MessageQueueWriter(
                self.world_size,
                n_local,
                connect_ip=ray.util.get_node_ip_address(),  # Ray's address is routable in-cluster
                name="rpc-broadcast",
            )
        )
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
        hooks = WorkerHooks(self._raise_if_dead, lambda: self._death, self._find_dead)
        self.rpc.connect(reply_handles, hooks, timeout_s)

    # ---- failure ----
    def _find_dead(self, wait_s: float) -> str | None:
        if self._death is None:
            self.group.report_dead(wait_s)
        return self._death

    def collective_rpc(self, *args: Any, **kwargs: Any) -> Any:  # see Executor
        self._raise_if_dead()
        assert self.rpc is not None
        return self.rpc.call(*args, **kwargs)

    # ---- shutdown ----
    def shutdown(self) -> None:
        with self._shutdown_lock:
            if self._shut_down:
                return
            self._shut_down = True
            self.group.stop_watching()
            running = self.rpc is not None and self.rpc.channel is not None
            asked = running and self._death is None and self.rpc.ask_workers_to_exit()
            self.group.stop(_SHUTDOWN_GRACE_S if asked else 0.0, graceful=self._runs)
            if self.rpc is not None:
                self.rpc.close()
