"""MPClient: a synchronous front end's engine cores in processes of their own, one per
data-parallel replica (the replica set: replica_set.py), over ZMQ (core_wire.py).

Waiting for outputs polls the output socket and every engine process's sentinel, so a replica
that dies ends the wait at once with EngineDeadError naming it (the whole engine fails, as it
does when a worker dies). Utility calls (`call`) go to each replica and wait for every answer;
step outputs that arrive meanwhile are kept for the next `get_output`. Drained replicas of a
scale-down are retired after every message (replica_set.py).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import zmq

from shardserve.config import EngineConfig
from shardserve.engine.core_client import EngineCoreClient
from shardserve.engine.core_launcher import EngineCoreGroup, EngineCoreProcess, describe_exit
from shardserve.engine.core_wire import (
    SHUTDOWN,
    EngineOutputs,
    EngineRequest,
    SchedulerStats,
    decode,
)
from shardserve.engine.dp_router import ReplicaRouter
from shardserve.engine.input_processor import EngineCoreRequest
from shardserve.engine.replica_set import ReplicaSet
from shardserve.errors import EngineDeadError
from shardserve.messages import EngineCoreOutput

logger = logging.getLogger(__name__)

# How often a wait for outputs re-checks that every engine process is alive.
_POLL_MS = 100


class MPClient(EngineCoreClient):
    def __init__(self, config: EngineConfig, start_timeout_s: float = 600.0) -> None:
        self.config = config
        self._closed = False
        self.dead_error: str | None = None
        self._buffered: list[EngineOutputs] = []  # step outputs that came during a call()
        self._sentinels: dict[int, EngineCoreProcess] = {}
        self.poller = zmq.Poller()
        self.replica_set = ReplicaSet(config, start_timeout_s)  # every replica ready
        self.router: ReplicaRouter = self.replica_set.router
        self.group: EngineCoreGroup = self.replica_set.group
        try:
            self.replica_set.open(zmq.Context(), self._watch, self._unwatch)
            self.poller.register(self.replica_set.out, zmq.POLLIN)
        except BaseException:
            self.shutdown()
            raise

    @property
    def num_replicas(self) -> int:
        return len(self.router.replicas)

    def _watch(self, proc: EngineCoreProcess) -> None:
        self._sentinels[proc.sentinel] = proc
        self.poller.register(proc.sentinel, zmq.POLLIN)

    def _unwatch(self, proc: EngineCoreProcess) -> None:
        if self._sentinels.pop(proc.sentinel, None) is not None:
            self.poller.unregister(proc.sentinel)

    def _send(self, replica: int, msg: EngineRequest) -> None:
        self.replica_set.send(replica, msg)

    def _check_alive(self) -> None:
        if self.dead_error is not None:
            raise EngineDeadError(self.dead_error)

    def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        self._check_alive()
        replica = self.router.assign([r.request_id for r in requests])
        for request in requests:
            self._send(replica, EngineRequest("add", request=request))

    def abort_requests(self, request_ids: list[str]) -> None:
        if self.dead_error is not None or self._closed:
            return
        for replica, ids in self.router.by_owner(request_ids).items():
            self._send(replica, EngineRequest("abort", request_ids=ids))
        self.router.finished(request_ids)
        self._retire_drained()

    def get_output(self) -> list[EngineCoreOutput]:
        self._check_alive()
        if self._buffered:
            return self._handle(self._buffered.pop(0))
        if not self.router.num_open:
            return []
        return self._handle(self._receive())

    def _receive(self) -> EngineOutputs:
        """The next message from any replica; EngineDeadError once a process has exited."""
        while True:
            events = dict(self.poller.poll(_POLL_MS))
            for fd, proc in list(self._sentinels.items()):
                if fd in events:
                    self._die(describe_exit(proc))
            if self.replica_set.out in events:
                return decode(self.replica_set.out.recv(copy=False))

    def _handle(self, msg: EngineOutputs) -> list[EngineCoreOutput]:
        self.router.on_stats(msg.engine_index, msg.stats)
        if msg.dead_error is not None:
            self._die(f"engine core {msg.engine_index} died: {msg.dead_error}")
        self.router.finished([o.request_id for o in msg.outputs if o.finished])
        self._retire_drained()
        return msg.outputs

    def _die(self, error: str) -> None:
        self.dead_error = error
        logger.error("%s; the engine is dead", error)
        raise EngineDeadError(error)

    def has_unfinished_requests(self) -> bool:
        return self.router.num_open > 0

    def stats(self) -> list[SchedulerStats]:
        return [self.router.stats[i] for i in self.router.replicas]

    def call(self, method: str, *args: Any, replicas: list[int] | None = None) -> list[Any]:
        self._check_alive()
        call = self.replica_set.begin_call(method, args, replicas)
        try:
            for replica in call.targets:
                self._send(replica, call.request)
            while not call.done:
                msg = self._receive()
                if msg.outputs or msg.dead_error is not None:
                    self._buffered.append(msg)  # for get_output, in order
                    continue
                self.router.on_stats(msg.engine_index, msg.stats)
                self.replica_set.on_utility(msg)
        finally:
            self.replica_set.end_call(call)
        return call.result()

    def scale(self, data_parallel_size: int) -> EngineCoreClient:
        self._check_alive()
        plan = self.replica_set.plan_scale(data_parallel_size)
        if plan.new:
            self.replica_set.start_replicas(plan)
            self.replica_set.add_started(plan)
        self._retire_drained()
        self.call("collective_rpc", *plan.resize_args, replicas=plan.kept)
        return self

    def _retire_drained(self) -> None:
        for i in self.replica_set.take_drained():
            with contextlib.suppress(zmq.ZMQError):
                self.replica_set.send(i, SHUTDOWN, zmq.NOBLOCK)
            self.group.stop_one(i)
            self.replica_set.forget(i)

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        for i in self.replica_set.stop_watching():
            with contextlib.suppress(zmq.ZMQError):
                self.replica_set.send(i, SHUTDOWN, zmq.NOBLOCK)
        self.group.stop()
        self.replica_set.close()
