"""The API server's engine cores: one process per data-parallel replica (core_launcher.py), an
input socket to each and one output socket from all, inside the event loop.

Re-scaling while serving (`scale`): new replicas start (in a thread: model loading must not
block the loop) with the config's data_parallel_size set to the new count, and take requests
once ready (the running ones take their new share of the cores); removed replicas (the
highest indices) take no new request at once and stop once the requests they run have
finished (`retire_drained`, after every message) — no request is lost or sent twice.
Utility calls (`call`: sleep, wake_up, is_sleeping, collective_rpc) go to each replica and
resolve when every answer is in.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import pickle
from collections.abc import Callable
from typing import Any

import zmq
import zmq.asyncio

from shardserve.config import EngineConfig
from shardserve.engine.core_launcher import EngineCoreGroup, EngineCoreProcess
from shardserve.engine.core_proc import EngineOutputs, EngineRequest, UtilityCall
from shardserve.engine.dp_router import ReplicaRouter, check_new_size, resized

logger = logging.getLogger(__name__)


class AsyncReplicas:
    def __init__(self, config: EngineConfig, start_timeout_s: float) -> None:
        self.config = config
        self.start_timeout_s = start_timeout_s
        self.router = ReplicaRouter(0)
        self.group = EngineCoreGroup(config, start_timeout_s)  # every replica ready
        for i in self.group.procs:
            self.router.add_replica(i)
        self._ctx: zmq.asyncio.Context | None = None
        self._ins: dict[int, zmq.asyncio.Socket] = {}
        self._on_exit: Callable[[EngineCoreProcess], None] | None = None
        self._calls: dict[int, tuple[asyncio.Future, dict[int, Any], set[int]]] = {}
        self._call_ids = itertools.count()
        self._scaling: asyncio.Lock | None = None  # created in start(), inside the loop

    async def start(self, on_exit: Callable[[EngineCoreProcess], None]) -> None:
        """Bind the sockets and watch every process (`on_exit` runs when one ends)."""
        self._ctx = zmq.asyncio.Context()
        self._on_exit = on_exit
        self._scaling = asyncio.Lock()
        self.out = self._ctx.socket(zmq.PULL)
        self.out.bind(self.group.output_addr)
        self._connect(list(self.group.procs))

    def _connect(self, indices: list[int]) -> None:
        assert self._ctx is not None and self._on_exit is not None
        loop = asyncio.get_running_loop()
        for i in indices:
            sock = self._ctx.socket(zmq.PUSH)
            sock.bind(self.group.input_addr(i))
            self._ins[i] = sock
            proc = self.group.procs[i]
            loop.add_reader(proc.sentinel, self._on_exit, proc)

    async def send(self, replica: int, msg: EngineRequest) -> None:
        await self._ins[replica].send(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL),
                                      copy=False)

    async def recv(self) -> EngineOutputs:
        return pickle.loads((await self.out.recv(copy=False)).buffer)

    # ---- utility calls ----
    async def call(self, method: str, *args: Any, replicas: list[int] | None = None
                   ) -> list[Any]:
        targets = self.router.serving if replicas is None else replicas
        bad = [r for r in targets if r not in self._ins]
        if bad:
            raise ValueError(f"replicas {bad} do not exist; there are {self.router.replicas}")
        call_id = next(self._call_ids)
        future = asyncio.get_running_loop().create_future()
        self._calls[call_id] = (future, {}, set(targets))
        try:
            for replica in targets:
                await self.send(replica, EngineRequest("utility",
                                                       call=UtilityCall(call_id, method, args)))
            results = await future
        finally:
            self._calls.pop(call_id, None)
        return [results[r] for r in targets]

    def on_utility(self, msg: EngineOutputs) -> None:
        """An answer to a call (from the outputs loop)."""
        assert msg.utility is not None
        entry = self._calls.get(msg.utility.call_id)
        if entry is None or entry[0].done():
            return
        future, results, waiting = entry
        if msg.utility.error is not None:
            future.set_exception(RuntimeError(
                f"engine core {msg.engine_index}: {msg.utility.error}"))
            return
        results[msg.engine_index] = msg.utility.result
        waiting.discard(msg.engine_index)
        if not waiting:
            future.set_result(results)

    def fail_calls(self, error: BaseException) -> None:
        for future, _, _ in self._calls.values():
            if not future.done():
                future.set_exception(error)

    # ---- re-scaling ----
    async def scale(self, data_parallel_size: int) -> list[int]:
        """Serve with `data_parallel_size` replicas; returns the serving indices."""
        check_new_size(self.config.parallel_config, data_parallel_size)
        assert self._scaling is not None
        async with self._scaling:
            new, kept = self.router.plan_scale(data_parallel_size)
            if new:
                config = resized(self.config, data_parallel_size)
                await asyncio.to_thread(self.group.start, config, new, self.start_timeout_s)
                self._connect(new)
                for i in new:
                    self.router.add_replica(i)
                logger.info("scaled up to %d replicas (started %s)", data_parallel_size, new)
            await self.retire_drained()
            await self.call("collective_rpc", "set_data_parallel_size", None,
                            (data_parallel_size,), None, replicas=kept)
            return self.router.serving

    async def retire_drained(self) -> list[int]:
        """Stop draining replicas that run nothing any more; returns their indices. (The
        outputs loop and a scale-down may both call it: the router forgets a replica before
        the first await, so each is stopped once.)"""
        retired = self.router.drained()
        procs = [(i, self.group.procs[i]) for i in retired]
        for i in retired:
            self.router.remove_replica(i)
        for i, proc in procs:
            with contextlib.suppress(Exception):
                asyncio.get_running_loop().remove_reader(proc.sentinel)  # not a death
            with contextlib.suppress(zmq.ZMQError):
                await self._ins[i].send(pickle.dumps(EngineRequest("shutdown")), zmq.NOBLOCK)
            await asyncio.to_thread(self.group.stop_one, i)
            self._ins.pop(i).close(linger=0)
            logger.info("engine core %d stopped (scaled down)", i)
        return retired

    # ---- shutdown ----
    async def stop(self) -> None:
        """Tell every replica to shut down, stop the processes, close the sockets."""
        loop = asyncio.get_running_loop()
        for i, proc in list(self.group.procs.items()):
            with contextlib.suppress(Exception):
                loop.remove_reader(proc.sentinel)
            if i in self._ins and proc.proc.is_alive():
                with contextlib.suppress(zmq.ZMQError):
                    await self._ins[i].send(pickle.dumps(EngineRequest("shutdown")),
                                            zmq.NOBLOCK)
        await asyncio.to_thread(self.group.stop)
        self.close_sockets()

    def stop_sync(self) -> None:
        """Outside the loop (start-up failed or was interrupted)."""
        self.group.stop()
        self.close_sockets()

    def close_sockets(self) -> None:
        if self._ctx is not None and not self._ctx.closed:
            self._ins.clear()
            self._ctx.destroy(linger=0)  # every socket, a half-made one too
