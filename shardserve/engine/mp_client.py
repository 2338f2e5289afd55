"""MPClient: a synchronous front end's engine cores in processes of their own, one per
data-parallel replica (core_launcher.py), over ZMQ (core_proc.py's messages).

Waiting for outputs polls the output socket and every engine process's sentinel, so a replica
that dies ends the wait at once with EngineDeadError naming it (the whole engine fails, as it
does when a worker dies). Utility calls (`call`) go to each replica and wait for every answer;
step outputs that arrive meanwhile are kept for the next `get_output`.

Re-scaling (`scale`): new replicas start with the config's data_parallel_size set to the new
count (their share of the cores and of the CPU KV budget); the running ones take their new
share of the cores (their KV cache stays as allocated). Removed replicas (the highest indices)
stop taking requests at once and are stopped once the requests they run have finished
(checked after every message).
"""

from __future__ import annotations

import itertools
import logging
import pickle
from typing import Any

import zmq

from shardserve.config import EngineConfig
from shardserve.engine.core_client import EngineCoreClient
from shardserve.engine.core_launcher import EngineCoreGroup, EngineCoreProcess, describe_exit
from shardserve.engine.core_proc import (
    EngineOutputs,
    EngineRequest,
    SchedulerStats,
    UtilityCall,
    UtilityResult,
)
from shardserve.engine.dp_router import ReplicaRouter, check_new_size, resized
from shardserve.engine.input_processor import EngineCoreRequest
from shardserve.errors import EngineDeadError
from shardserve.messages import EngineCoreOutput

logger = logging.getLogger(__name__)

# How often a wait for outputs re-checks that every engine process is alive.
_POLL_MS = 100


class MPClient(EngineCoreClient):
    def __init__(self, config: EngineConfig, start_timeout_s: float = 600.0) -> None:
        self.config = config
        self.start_timeout_s = start_timeout_s
        self.router = ReplicaRouter(0)
        self._closed = False
        self.dead_error: str | None = None
        self.ins: dict[int, zmq.Socket] = {}
        self._sentinels: dict[int, EngineCoreProcess] = {}
        self._buffered: list[EngineOutputs] = []  # step outputs that came during a call()
        self._call_ids = itertools.count()
        self.group = EngineCoreGroup(config, start_timeout_s)
        self.ctx = zmq.Context()
        self.poller = zmq.Poller()
        try:
            self.out = self.ctx.socket(zmq.PULL)
            self.out.bind(self.group.output_addr)
            self.poller.register(self.out, zmq.POLLIN)
            self._connect(list(self.group.procs))
        except BaseException:
            self.shutdown()
            raise

    @property
    def num_replicas(self) -> int:
        return len(self.router.replicas)

    def _connect(self, indices: list[int]) -> None:
        """Bind the input sockets of started replicas, watch them, route to them."""
        for i in indices:
            sock = self.ctx.socket(zmq.PUSH)
            sock.bind(self.group.input_addr(i))
            self.ins[i] = sock
            proc = self.group.procs[i]
            self._sentinels[proc.sentinel] = proc
            self.poller.register(proc.sentinel, zmq.POLLIN)
            self.router.add_replica(i)

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
            if self.out in events:
                return pickle.loads(self.out.recv(copy=False).buffer)

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
        targets = self.router.serving if replicas is None else replicas
        bad = [r for r in targets if r not in self.ins]
        if bad:
            raise ValueError(f"replicas {bad} do not exist; there are {self.router.replicas}")
        call_id = next(self._call_ids)
        for replica in targets:
            self._send(replica, EngineRequest("utility", call=UtilityCall(call_id, method, args)))
        results: dict[int, UtilityResult] = {}
        while len(results) < len(targets):
            msg = self._receive()
            if msg.utility is not None and msg.utility.call_id == call_id:
                self.router.on_stats(msg.engine_index, msg.stats)
                results[msg.engine_index] = msg.utility
            elif msg.outputs or msg.dead_error is not None:
                self._buffered.append(msg)
            else:
                self.router.on_stats(msg.engine_index, msg.stats)
        for replica in targets:
            if results[replica].error is not None:
                raise RuntimeError(f"engine core {replica}: {method}: {results[replica].error}")
        return [results[r].result for r in targets]

    # ---- re-scaling ----
    def scale(self, data_parallel_size: int) -> None:
        self._check_alive()
        check_new_size(self.config.parallel_config, data_parallel_size)
        new, kept = self.router.plan_scale(data_parallel_size)
        if new:
            config = resized(self.config, data_parallel_size)
            self.group.start(config, new, self.start_timeout_s)
            self._connect(new)
            logger.info("scaled up to %d replicas (started %s)", data_parallel_size, new)
        self._retire_drained()
        self.call("collective_rpc", "set_data_parallel_size", None, (data_parallel_size,), None,
                  replicas=kept)

    def _retire_drained(self) -> None:
        for i in self.router.drained():
            proc = self.group.procs[i]
            self.poller.unregister(proc.sentinel)
            del self._sentinels[proc.sentinel]
            try:
                self._send(i, EngineRequest("shutdown"))
            except zmq.ZMQError:
                pass
            self.group.stop_one(i)
            self.ins.pop(i).close(linger=0)
            self.router.remove_replica(i)
            logger.info("engine core %d stopped (scaled down)", i)

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        for sock in self.ins.values():
            try:
                sock.send(pickle.dumps(EngineRequest("shutdown")), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        self.group.stop()
        self.ctx.destroy(linger=0)  # every socket, a half-made one too
