"""AsyncMPClient: the engine-core processes of an asyncio front end (async_engine.py, so the API
server and AsyncLLM): the replica set (replica_set.py) inside the event loop.

The sockets are zmq.asyncio ones, each process's sentinel is a reader of the loop (its exit calls
`on_exit`), and what blocks (starting replicas: model loading; stopping them) runs in a thread.
Re-scaling while serving (`scale`): new replicas take requests once ready, removed ones stop
once the requests they run have finished (`retire_drained`, after every message): no request is
lost or sent twice. Utility calls (`call`: sleep, wake_up, is_sleeping, collective_rpc) go to
each replica and resolve when every answer is in, or fail at once when the engine dies
(`fail_calls`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

import zmq
import zmq.asyncio

from shardserve.config import EngineConfig
from shardserve.engine.core_launcher import EngineCoreGroup, EngineCoreProcess
from shardserve.engine.core_wire import SHUTDOWN, EngineOutputs, EngineRequest, decode
from shardserve.engine.dp_router import ReplicaRouter, check_new_size
from shardserve.engine.replica_set import ReplicaSet


class AsyncMPClient:
    def __init__(self, config: EngineConfig, start_timeout_s: float) -> None:
        self.replica_set = ReplicaSet(config, start_timeout_s)  # every replica ready
        self.router: ReplicaRouter = self.replica_set.router
        self.group: EngineCoreGroup = self.replica_set.group
        self._loop: asyncio.AbstractEventLoop | None = None
        self._on_exit: Callable[[EngineCoreProcess], None] | None = None
        self._waiting: dict[int, asyncio.Future] = {}  # by call id
        self._scaling: asyncio.Lock | None = None  # created in start(), inside the loop

    async def start(self, on_exit: Callable[[EngineCoreProcess], None]) -> None:
        """Bind the sockets and watch every process (`on_exit` runs when one ends)."""
        self._loop = asyncio.get_running_loop()
        self._on_exit = on_exit
        self._scaling = asyncio.Lock()
        self.replica_set.open(zmq.asyncio.Context(), self._watch, self._unwatch)

    def _watch(self, proc: EngineCoreProcess) -> None:
        assert self._loop is not None and self._on_exit is not None
        self._loop.add_reader(proc.sentinel, self._on_exit, proc)

    def _unwatch(self, proc: EngineCoreProcess) -> None:
        if self._loop is not None:
            with contextlib.suppress(Exception):
                self._loop.remove_reader(proc.sentinel)

    async def send(self, replica: int, msg: EngineRequest) -> None:
        await self.replica_set.send(replica, msg)

    async def recv(self) -> EngineOutputs:
        assert self.replica_set.out is not None
        return decode(await self.replica_set.out.recv(copy=False))

    # ---- utility calls ----
    async def call(self, method: str, *args: Any, replicas: list[int] | None = None
                   ) -> list[Any]:
        future = asyncio.get_running_loop().create_future()
        call = self.replica_set.begin_call(method, args, replicas, on_done=lambda: _resolve(future))
        self._waiting[call.call_id] = future
        try:
            for replica in call.targets:
                await self.send(replica, call.request)
            if not call.done:
                await future
        finally:
            self.replica_set.end_call(call)
            del self._waiting[call.call_id]
        return call.result()

    def on_utility(self, msg: EngineOutputs) -> None:
        """An answer to a call (from the outputs loop)."""
        self.replica_set.on_utility(msg)

    def fail_calls(self, error: BaseException) -> None:
        for future in self._waiting.values():
            if not future.done():
                future.set_exception(error)

    # ---- re-scaling ----
    async def scale(self, data_parallel_size: int) -> list[int]:
        """Serve with `data_parallel_size` replicas; returns the serving indices."""
        # A bad size is refused at once, not after a re-scale in progress.
        check_new_size(self.replica_set.config.parallel_config, data_parallel_size)
        assert self._scaling is not None
        async with self._scaling:  # one re-scale at a time: each plans from the last one's end
            plan = self.replica_set.plan_scale(data_parallel_size)
            if plan.new:
                await asyncio.to_thread(self.replica_set.start_replicas, plan)
                self.replica_set.add_started(plan)
            await self.retire_drained()
            await self.call("collective_rpc", *plan.resize_args, replicas=plan.kept)
            return self.router.serving

    async def retire_drained(self) -> list[int]:
        """Stop draining replicas that run nothing any more; returns their indices. (The
        outputs loop and a scale-down may both call it: each replica is taken once.)"""
        retired = self.replica_set.take_drained()
        for i in retired:
            with contextlib.suppress(zmq.ZMQError):
                await self.replica_set.send(i, SHUTDOWN, zmq.NOBLOCK)
            await asyncio.to_thread(self.group.stop_one, i)
            self.replica_set.forget(i)
        return retired

    # ---- shutdown ----
    async def stop(self) -> None:
        """Tell every replica to shut down, stop the processes, close the sockets."""
        for i in self.replica_set.stop_watching():
            with contextlib.suppress(zmq.ZMQError):
                await self.replica_set.send(i, SHUTDOWN, zmq.NOBLOCK)
        await asyncio.to_thread(self.group.stop)
        self.replica_set.close()

    def stop_sync(self) -> None:
        """Outside the loop (start-up failed or was interrupted)."""
        self.group.stop()
        self.replica_set.close()

    def close_sockets(self) -> None:
        self.replica_set.close()


def _resolve(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)
