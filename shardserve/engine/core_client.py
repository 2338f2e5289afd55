"""EngineCoreClient: what a synchronous front end (LLMEngine, so `LLM`) needs of its engine
cores, with two implementations:

* `InprocClient`: one EngineCore in this process (data_parallel_size=1): `get_output()` is one
  `EngineCore.step()`, nothing crosses a process boundary.
* `MPClient`: `data_parallel_size` engine cores, each in its own process with its own executor
  (core_proc.py, the process the API server runs too), over ZMQ: typed `EngineRequest`s out,
  `EngineOutputs` back. Requests go to the least loaded replica (dp_router.py).

The asyncio front end (the API server, AsyncLLM) is server/async_engine.py over the same
processes and messages.
"""

from __future__ import annotations

import itertools
import logging
import pickle
from abc import ABC, abstractmethod
from typing import Any

import zmq

from shardserve.config import EngineConfig
from shardserve.engine.core import EngineCore
from shardserve.engine.core_launcher import EngineCoreGroup, describe_exit
from shardserve.engine.core_proc import (
    UTILITY_METHODS,
    EngineOutputs,
    EngineRequest,
    SchedulerStats,
    UtilityCall,
    UtilityResult,
    scheduler_stats,
)
from shardserve.engine.dp_router import ReplicaRouter
from shardserve.engine.input_processor import EngineCoreRequest
from shardserve.errors import EngineDeadError
from shardserve.messages import EngineCoreOutput

logger = logging.getLogger(__name__)

# How often a wait for outputs re-checks that every engine process is alive.
_POLL_MS = 100


class EngineCoreClient(ABC):
    @abstractmethod
    def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        """Queue one request's children (they go to the same engine core)."""

    @abstractmethod
    def abort_requests(self, request_ids: list[str]) -> None: ...

    @abstractmethod
    def get_output(self) -> list[EngineCoreOutput]:
        """The next outputs (maybe none: call again while requests are unfinished); raises
        EngineDeadError when an engine core has died."""

    @abstractmethod
    def has_unfinished_requests(self) -> bool: ...

    @abstractmethod
    def stats(self) -> list[SchedulerStats]:
        """Each engine core's latest figures, by replica index."""

    @abstractmethod
    def call(self, method: str, *args: Any, replicas: list[int] | None = None) -> list[Any]:
        """Run an engine-core method (core_proc.UTILITY_METHODS) on each replica (default all)
        and return their results in replica order; the first failure raises RuntimeError."""

    @abstractmethod
    def shutdown(self) -> None:
        """Idempotent: stop the engine cores and free what this client created."""


def make_client(config: EngineConfig) -> EngineCoreClient:
    if config.parallel_config.data_parallel_size == 1:
        return InprocClient(config)
    return MPClient(config)


class InprocClient(EngineCoreClient):
    def __init__(self, config: EngineConfig) -> None:
        self.core = EngineCore(config)

    def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        for request in requests:
            self.core.add_request(request.to_request())

    def abort_requests(self, request_ids: list[str]) -> None:
        self.core.abort_requests(request_ids)

    def get_output(self) -> list[EngineCoreOutput]:
        return self.core.step()

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def stats(self) -> list[SchedulerStats]:
        return [scheduler_stats(self.core)]

    def call(self, method: str, *args: Any, replicas: list[int] | None = None) -> list[Any]:
        if method not in UTILITY_METHODS:
            raise ValueError(f"{method!r} is not one of {sorted(UTILITY_METHODS)}")
        if replicas not in (None, [0]):
            raise ValueError(f"replicas={replicas}: there is one engine core (replica 0)")
        if method == "collective_rpc":
            return [self.core.executor.collective_rpc(*args)]
        return [getattr(self.core, method)(*args)]

    def shutdown(self) -> None:
        self.core.shutdown()


class MPClient(EngineCoreClient):
    def __init__(self, config: EngineConfig, start_timeout_s: float = 600.0) -> None:
        self.num_replicas = config.parallel_config.data_parallel_size
        self.router = ReplicaRouter(self.num_replicas)
        self._closed = False
        self.dead_error: str | None = None
        self.group = EngineCoreGroup(config, start_timeout_s)
        self.ctx = zmq.Context()
        try:
            self.out = self.ctx.socket(zmq.PULL)
            self.out.bind(self.group.output_addr)
            self.ins = []
            for addr in self.group.input_addrs:
                sock = self.ctx.socket(zmq.PUSH)
                sock.bind(addr)
                self.ins.append(sock)
        except BaseException:
            self.shutdown()
            raise
        self._buffered: list[EngineOutputs] = []  # step outputs that came during a call()
        self._call_ids = itertools.count()
        self.poller = zmq.Poller()
        self.poller.register(self.out, zmq.POLLIN)
        self._sentinels = self.group.sentinels()
        for fd in self._sentinels:
            self.poller.register(fd, zmq.POLLIN)

    def _send(self, replica: int, msg: EngineRequest) -> None:
        self.ins[replica].send(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL), copy=False)

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
            for fd, proc in self._sentinels.items():
                if fd in events:
                    self._die(describe_exit(proc))
            if self.out in events:
                return pickle.loads(self.out.recv(copy=False).buffer)

    def call(self, method: str, *args: Any, replicas: list[int] | None = None) -> list[Any]:
        self._check_alive()
        targets = list(range(self.num_replicas)) if replicas is None else replicas
        bad = [r for r in targets if not 0 <= r < self.num_replicas]
        if bad:
            raise ValueError(f"replicas {bad} do not exist; there are {self.num_replicas}")
        call_id = next(self._call_ids)
        for replica in targets:
            self._send(replica, EngineRequest("utility", call=UtilityCall(call_id, method, args)))
        results: dict[int, UtilityResult] = {}
        while len(results) < len(targets):
            msg = self._receive()
            if msg.utility is not None and msg.utility.call_id == call_id:
                results[msg.engine_index] = msg.utility
            elif msg.outputs or msg.dead_error is not None:
                self._buffered.append(msg)
            else:
                self.router.on_stats(msg.engine_index, msg.stats)
        for replica in targets:
            if results[replica].error is not None:
                raise RuntimeError(f"engine core {replica}: {method}: {results[replica].error}")
        return [results[r].result for r in targets]

    def _handle(self, msg: EngineOutputs) -> list[EngineCoreOutput]:
        self.router.on_stats(msg.engine_index, msg.stats)
        if msg.dead_error is not None:
            self._die(f"engine core {msg.engine_index} died: {msg.dead_error}")
        self.router.finished([o.request_id for o in msg.outputs if o.finished])
        return msg.outputs

    def _die(self, error: str) -> None:
        self.dead_error = error
        logger.error("%s; the engine is dead", error)
        raise EngineDeadError(error)

    def has_unfinished_requests(self) -> bool:
        return self.router.num_open > 0

    def stats(self) -> list[SchedulerStats]:
        return list(self.router.stats)

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        for sock in getattr(self, "ins", []):
            try:
                sock.send(pickle.dumps(EngineRequest("shutdown")), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        self.group.stop()
        for sock in [*getattr(self, "ins", []), *([self.out] if hasattr(self, "out") else [])]:
            sock.close(linger=0)
        self.ctx.term()
