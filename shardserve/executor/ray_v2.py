"""RayExecutorV2 (`ray_v2`): Ray places and supervises the workers; shardserve moves the data.

    RayWorkerGroup (ray_workers.py): placement group, one actor per rank, init_worker
    collective_rpc ──RpcRequest──▶ broadcast MessageQueue ──▶ actor.run(): run_busy_loop
                                   ranks on the driver's node: shared memory (0..n_local-1)
                                   ranks on other nodes: TCP
    RpcChannel     ◀──RpcReply─── one reply MessageQueue per rank (shm or TCP, likewise)

The RPC bookkeeping is the mp backend's (rpc_channel.py); Ray only hosts the processes. Each
actor's run() call lasts as long as its busy loop, so its ref finishing is the death signal.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from typing import Any

import ray

from shardserve.errors import EngineDeadError
from shardserve.executor.abstract import Executor
from shardserve.executor.ray_workers import RayWorkerGroup
from shardserve.executor.rpc_channel import RpcChannel, WorkerHooks
from shardserve.ipc import Handle, MessageQueue
from shardserve.ipc.rpc import SHUTDOWN, RpcRequest

logger = logging.getLogger(__name__)

_SHUTDOWN_GRACE_S = 2.0


class RayExecutorV2(Executor):
    uses_ray = True

    def _init_executor(self) -> None:
        pc = self.parallel_config
        self.world_size = pc.world_size
        self._shutdown_lock = threading.Lock()
        self.broadcast: MessageQueue | None = None
        self.reply_queues: list[MessageQueue] = []
        self._reply_handles: list[Handle] = []
        self._runs: list[Any] = []  # each actor's run() call: ends with its busy loop
        self.channel: RpcChannel | None = None
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
        self.broadcast = MessageQueue(
            self.world_size,
            n_local,
            connect_ip=ray.util.get_node_ip_address(),  # Ray's address is routable in-cluster
            name="rpc-broadcast",
        )
        handle = self.broadcast.export_handle()
        self._reply_handles = ray.get(
            [a.open_reply_queue.remote(handle, r < n_local) for r, a in enumerate(actors)],
            timeout=timeout_s,
        )
        # Ordering: run() must be under way before we wait on the broadcast queue, since each
        # worker attaches to it inside run(); and we attach to the reply queues first, since
        # each worker waits for the broadcast handshake before waiting for our attachment.
        runs = {a.run.remote(): r for r, a in enumerate(actors)}
        self.group.watch({**runs, **self.group.lifelines})
        self.reply_queues = [
            MessageQueue.create_from_handle(h, 0, name=f"replies-from-TP{r}")
            for r, h in enumerate(self._reply_handles)
        ]
        self.broadcast.wait_until_ready(timeout=timeout_s)
        for mq in self.reply_queues:
            mq.wait_until_ready(timeout=timeout_s)
        self._runs = list(runs)
        self.channel = RpcChannel(
            self.broadcast,
            self.reply_queues,
            WorkerHooks(self._raise_if_dead, lambda: self._death, self._find_dead),
        )

    # ---- failure ----
    def _find_dead(self, wait_s: float) -> str | None:
        if self._death is None:
            self.group.report_dead(wait_s)
        return self._death

    # ---- RPC ----
    def collective_rpc(
        self,
        method: str | Callable[..., Any],
        timeout: float | None = None,
        args: tuple = (),
        kwargs: dict[str, Any] | None = None,
        non_block: bool = False,
        unique_reply_rank: int | None = None,
    ) -> Any:
        self._raise_if_dead()
        assert self.channel is not None
        return self.channel.call(method, timeout, args, kwargs, non_block, unique_reply_rank)

    # ---- shutdown ----
    def shutdown(self) -> None:
        with self._shutdown_lock:
            if self._shut_down:
                return
            self._shut_down = True
            self.group.stop_watching()
            grace_s = 0.0
            if self.channel is not None and self._death is None:  # running: ask them to exit
                grace_s = _SHUTDOWN_GRACE_S
                try:
                    self.channel.broadcast.enqueue(RpcRequest(0, SHUTDOWN, (), {}), timeout=1.0)
                except Exception as e:
                    logger.warning("could not ask the workers to exit (%s); killing them", e)
            self.group.stop(grace_s, graceful=self._runs)
            for mq in [*self.reply_queues, self.broadcast]:
                if mq is not None:
                    mq.close()
            for h in self._reply_handles:  # a killed worker could not unlink its reply ring
                if h.shm_name:
                    _unlink_shm(h.shm_name)
            if self.channel is not None:
                self.channel.fail_pending(EngineDeadError("the executor was shut down"))


def _unlink_shm(name: str) -> None:
    try:
        os.unlink(os.path.join("/dev/shm", name.lstrip("/")))
    except FileNotFoundError:
        pass
