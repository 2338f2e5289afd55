"""ReplicaSet: a front end's engine-core replicas and its sockets to them, shared by the
synchronous MPClient (mp_client.py) and the asyncio AsyncMPClient (async_mp_client.py).

It owns the processes (core_launcher.py), the router (dp_router.py), one input socket per
replica and the output socket (core_wire.py has the layout), the watch on each process, the call
ids and answers of utility calls, the re-scaling plan and the retirement of drained replicas.
Its client owns the waiting (a blocking poll, or the event loop) and decides where the blocking
steps run (in place, or in a thread): starting and stopping processes.

Sockets come from the client's context (zmq.Context or zmq.asyncio.Context), so `send` returns
what the socket's send returns: None, or an awaitable that the asyncio client awaits.

Re-scaling: new replicas start with the config's data_parallel_size set to the new count (their
share of the cores and of the CPU KV budget), and the running ones are then told their new share
of the cores (their KV cache stays as allocated). Removed replicas (the highest indices) take no
new request at once (the router's `draining`) and are retired once the requests they run have
finished: the client checks `take_drained()` after every message.

Recovery (replica_recovery.py): a replica that died is taken down (`take_down`: unwatched, its
calls answered with the death, its requests handed back), stopped (`stop_dead`, blocking: its
workers too), started again at the same index with the config it had (`restart`, blocking) and
routed to once ready (`add_restarted`). A message its dead predecessor sent before dying may still
be queued: `is_current` tells it apart by the sender's pid, and the client drops it.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zmq

from shardserve.config import EngineConfig
from shardserve.engine.core_launcher import EngineCoreGroup, EngineCoreProcess
from shardserve.engine.core_wire import (
    EngineOutputs,
    EngineRequest,
    UtilityCall,
    UtilityResult,
    encode,
)
from shardserve.engine.dp_router import ReplicaRouter, check_new_size, resized

logger = logging.getLogger(__name__)

Watch = Callable[[EngineCoreProcess], None]


@dataclass(frozen=True)
class ScalePlan:
    """A re-scale: start `new` (with `config`), retire the drained, then tell the `kept` ones
    their share of the cores (`collective_rpc` with `resize_args`)."""

    size: int
    config: EngineConfig
    new: list[int]
    kept: list[int]

    @property
    def resize_args(self) -> tuple:
        return ("set_data_parallel_size", None, (self.size,), None)


class PendingCall:
    """One utility call to some replicas: their answers as they come."""

    def __init__(self, call_id: int, method: str, args: tuple, targets: list[int],
                 on_done: Callable[[], None] | None) -> None:
        self.call_id = call_id
        self.method = method
        self.targets = targets
        self.request = EngineRequest("utility", call=UtilityCall(call_id, method, args))
        self._on_done = on_done
        self._answers: dict[int, UtilityResult] = {}

    @property
    def done(self) -> bool:
        return all(r in self._answers for r in self.targets)

    def answer(self, replica: int, result: UtilityResult) -> None:
        self._answers[replica] = result
        if self.done and self._on_done is not None:
            self._on_done()

    def result(self) -> list[Any]:
        """Each target's result in target order; the first failure (in that order) raises:
        a ValueError where the core's was one (bad input), else a RuntimeError."""
        for replica in self.targets:
            answer = self._answers[replica]
            if answer.error is not None:
                kind = ValueError if answer.bad_input else RuntimeError
                raise kind(f"engine core {replica}: {self.method}: {answer.error}")
        return [self._answers[r].result for r in self.targets]


class ReplicaSet:
    def __init__(self, config: EngineConfig, start_timeout_s: float) -> None:
        self.config = config
        self.start_timeout_s = start_timeout_s
        self.router = ReplicaRouter(0)
        self.group = EngineCoreGroup(config, start_timeout_s)  # every replica ready
        for i in self.group.procs:
            self.router.add_replica(i)
        self.ctx: zmq.Context | None = None
        self.out: zmq.Socket | None = None
        self.ins: dict[int, zmq.Socket] = {}
        self._watch: Watch | None = None
        self._unwatch: Watch | None = None
        self._calls: dict[int, PendingCall] = {}
        self._call_ids = itertools.count()
        # The config each replica started with (a re-scale starts new ones with another).
        self._configs: dict[int, EngineConfig] = dict.fromkeys(self.group.procs, config)

    def open(self, ctx: zmq.Context, watch: Watch, unwatch: Watch) -> None:
        """Bind the output socket and every replica's input socket; `watch(proc)` each process
        (its exit is a death, until `unwatch(proc)`)."""
        self.ctx, self._watch, self._unwatch = ctx, watch, unwatch
        self.out = ctx.socket(zmq.PULL)
        self.out.bind(self.group.output_addr)
        self._bind(list(self.group.procs))

    def _bind(self, indices: list[int]) -> None:
        assert self.ctx is not None and self._watch is not None
        for i in indices:
            sock = self.ctx.socket(zmq.PUSH)
            sock.bind(self.group.input_addr(i))
            self.ins[i] = sock
            self._watch(self.group.procs[i])

    def send(self, replica: int, msg: EngineRequest, flags: int = 0) -> Any:
        return self.ins[replica].send(encode(msg), flags, copy=False)

    # ---- utility calls ----
    def begin_call(self, method: str, args: tuple, replicas: list[int] | None,
                   on_done: Callable[[], None] | None = None) -> PendingCall:
        """A call to `replicas` (default: the serving ones); the client sends `call.request`
        to each target, feeds answers to `on_utility` and ends with `end_call`."""
        targets = self.router.serving if replicas is None else replicas
        bad = [r for r in targets if r not in self.ins]
        if bad:
            raise ValueError(f"replicas {bad} do not exist; there are {self.router.replicas}")
        call = PendingCall(next(self._call_ids), method, args, list(targets), on_done)
        self._calls[call.call_id] = call
        return call

    def end_call(self, call: PendingCall) -> None:
        self._calls.pop(call.call_id, None)

    def on_utility(self, msg: EngineOutputs) -> None:
        """Record an answer (one to a call already ended is dropped)."""
        if msg.utility is not None and (call := self._calls.get(msg.utility.call_id)):
            call.answer(msg.engine_index, msg.utility)

    # ---- re-scaling ----
    def plan_scale(self, size: int) -> ScalePlan:
        """Start draining replicas, or take draining ones back (dp_router.py)."""
        check_new_size(self.config.parallel_config, size)
        new, kept = self.router.plan_scale(size)
        return ScalePlan(size, resized(self.config, size), new, kept)

    def start_replicas(self, plan: ScalePlan) -> None:
        """Blocking (model loading): start the plan's new replicas; then `add_started`."""
        self.group.start(plan.config, plan.new, self.start_timeout_s)
        self._configs.update(dict.fromkeys(plan.new, plan.config))

    def add_started(self, plan: ScalePlan) -> None:
        """Connect the replicas just started and route to them."""
        self._bind(plan.new)
        for i in plan.new:
            self.router.add_replica(i)
        logger.info("scaled up to %d replicas (started %s)", plan.size, plan.new)

    def take_drained(self) -> list[int]:
        """Draining replicas that run nothing any more, forgotten by the router and no longer
        watched (their exit is no death). The client tells each to shut down (`SHUTDOWN`, not
        blocking), stops it (`group.stop_one`, blocking) and then calls `forget`. Each is taken
        once, however often this is called while they stop."""
        retired = self.router.drained()
        for i in retired:
            self.router.remove_replica(i)
            assert self._unwatch is not None
            self._unwatch(self.group.procs[i])
        return retired

    def forget(self, index: int) -> None:
        self.ins.pop(index).close(linger=0)
        logger.info("engine core %d stopped (scaled down)", index)

    # ---- recovery ----
    def is_current(self, msg: EngineOutputs) -> bool:
        """Sent by the replica's live process (not a dead predecessor, not a replica down)."""
        proc = self.group.procs.get(msg.engine_index)
        return (proc is not None and msg.engine_index not in self.router.down
                and msg.pid == proc.proc.pid)

    def take_down(self, index: int, cause: str) -> list[str]:
        """Replica `index` died: no longer watched or routed to; calls waiting on it are
        answered with `cause`; returns the request ids it owned."""
        proc = self.group.procs.get(index)
        if proc is not None and self._unwatch is not None:
            self._unwatch(proc)
        for call in list(self._calls.values()):
            if index in call.targets:
                call.answer(index, UtilityResult(call.call_id, error=f"EngineDeadError: {cause}"))
        return self.router.take_down(index)

    def close_input(self, index: int) -> None:
        """In the client's thread (sockets are not thread-safe): a dead replica's input socket.
        (An engine core that reported its executor's death ends by itself; `stop_dead` gives
        it the time before it closes the death pipe.)"""
        sock = self.ins.pop(index, None)
        if sock is not None:
            sock.close(linger=0)

    def stop_dead(self, index: int) -> None:
        """Blocking, after close_input: stop what is left of a dead replica (its workers)."""
        if index in self.group.procs:
            self.group.stop_one(index)

    def restart(self, index: int, timeout_s: float) -> None:
        """Blocking (model loading): start replica `index` again as it was."""
        self.group.start(self._configs[index], [index], timeout_s)

    def forget_dead(self, index: int) -> None:
        """A draining replica that died (after stop_dead): gone, as a retired one is."""
        self.router.remove_replica(index)
        self.router.down.discard(index)
        self._configs.pop(index, None)
        logger.info("engine core %d gone (it died while it drained)", index)

    def add_restarted(self, index: int) -> None:
        self._bind([index])
        self.router.bring_up(index)

    # ---- shutdown ----
    def stop_watching(self) -> list[int]:
        """Before stopping them all: no exit is a death any more. Returns the replicas alive
        with a socket, to be told to shut down (not blocking) before `group.stop()`."""
        live = []
        for i, proc in list(self.group.procs.items()):
            if self._unwatch is not None:
                self._unwatch(proc)
            if i in self.ins and proc.proc.is_alive():
                live.append(i)
        return live

    def close(self) -> None:
        """After the processes stopped: every socket, a half-made one too."""
        if self.ctx is not None and not self.ctx.closed:
            self.ins.clear()
            self.ctx.destroy(linger=0)
