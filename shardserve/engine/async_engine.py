"""AsyncEngineClient: the asyncio front end (the API server, AsyncLLM) over the engine-core
processes (one per data-parallel replica, async_mp_client.py; requests go to the least loaded,
dp_router.py).

Tokenization happens in `add_request`, detokenization in the outputs loop (an asyncio task that
reads the output socket and feeds the OutputProcessor), so both overlap the engine's model steps.
Each request gets an OutputCollector: outputs are cumulative, so a newer one replaces one the
client has not taken yet, and a request holds one output however slowly its client reads.

Failure: a "dead" message from an engine core, or any engine process exiting (sentinel
readable), is that replica's death. With restarts allowed (RecoveryConfig, replica_recovery.py)
the replica is restarted and its requests move on, unseen by their clients; otherwise (or past
the restart bound) it marks the client dead: every collector receives the EngineDeadError, so
every open request ends at once, and new requests are refused with it; then `on_dead` (the
server's exit) runs.

Admission (`max_queued`): engine requests beyond the engine's batch (`max_num_seqs`) wait in its
queue; past `max_queued` of them a new request is refused with QueueFullError (503 +
Retry-After) before it reaches the engine. Drain (`begin_drain`): new requests are refused,
open ones finish; after the deadline the rest end with an error.

Metrics: what happens is reported to `metrics` (the server's Prometheus registry; by default
NoMetrics, which keeps nothing), so this layer needs no metrics library.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import zmq

from shardserve.config import EngineConfig
from shardserve.engine.async_mp_client import AsyncMPClient
from shardserve.engine.async_outputs import NoMetrics, OutputCollector, QueueFullError, StatsLog
from shardserve.engine.core_launcher import EngineCoreProcess, describe_exit
from shardserve.engine.core_wire import EngineOutputs, EngineRequest, SchedulerStats, sum_stats
from shardserve.engine.dp_router import NoReplicaUpError
from shardserve.engine.input_processor import EngineCoreRequest, InputProcessor
from shardserve.engine.lora_requests import AsyncFrontEndLoRAs
from shardserve.engine.output_processor import OutputProcessor
from shardserve.engine.replica_recovery import ReplicaRecovery
from shardserve.errors import EngineDeadError
from shardserve.lora.request import LoRARequest
from shardserve.model.loader import load_tokenizer
from shardserve.outputs import RequestOutput
from shardserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

class AsyncEngineClient:
    def __init__(self, config: EngineConfig, start_timeout_s: float = 600.0,
                 max_queued: int | None = None, stream_interval: int = 1,
                 metrics: Any = None) -> None:
        if max_queued is not None and max_queued < 0:
            raise ValueError(f"--max-queued-requests={max_queued} must be >= 0")
        self.config = config
        self.max_queued = max_queued
        self.on_dead: Callable[[str], None] | None = None  # called once, after clients heard
        self._num_engine_requests = 0  # children of the open requests
        self.tokenizer = load_tokenizer(config.model_config.tokenizer_path,
                                        config.model_config.trust_remote_code)
        self.inputs = InputProcessor(config, self.tokenizer)
        self.processor = OutputProcessor(self.tokenizer, stream=True,
                                         stream_interval=stream_interval)
        self.metrics = NoMetrics() if metrics is None else metrics
        self.dead_error: str | None = None
        self._queues: dict[str, OutputCollector] = {}
        self._closing = False
        self._draining = False  # a stop signal came: refuse new requests, end open ones
        self._loop: asyncio.AbstractEventLoop | None = None
        self._outputs_task: asyncio.Task | None = None
        self._stats_task: asyncio.Task | None = None
        self._stats_log = StatsLog()  # the periodic throughput line
        # Spawns every replica's engine core and waits until each has loaded its model.
        self.replicas = AsyncMPClient(config, start_timeout_s)
        self.router = self.replicas.router
        self.replica_set = self.replicas.replica_set
        # Each open child request as sent, to move it if its replica dies (replica_recovery.py).
        self._core_requests: dict[str, EngineCoreRequest] = {}
        self.recovery = ReplicaRecovery(config.recovery_config, self)
        self.loras = AsyncFrontEndLoRAs(config, self.call)  # add/remove/pin/list adapters
        self.metrics.set_replicas(len(self.router.serving), self.router.replicas)

    # ---- lifecycle (inside the event loop) ----
    @property
    def stats(self) -> SchedulerStats:
        """The replicas' latest figures, summed."""
        return sum_stats(list(self.router.stats.values()))

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        await self.replicas.start(self._on_process_exit)
        self._outputs_task = asyncio.create_task(self._outputs_loop(), name="engine-outputs")
        if not self.config.observability_config.disable_log_stats:
            self._stats_task = asyncio.create_task(self._stats_log.run(lambda: self.stats),
                                                  name="log-stats")

    async def shutdown(self) -> None:
        """Idempotent: stop the engine process and free everything we created."""
        if self._closing:
            return
        self._closing = True
        await self.recovery.stop()
        await self.replicas.stop()
        if self._stats_task is not None:
            self._stats_task.cancel()
        if self._outputs_task is not None:
            self._outputs_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._outputs_task
        self._fail_all("the server is shutting down")

    def begin_drain(self, timeout_s: float) -> None:
        """From a signal handler: refuse new requests, let open ones finish, and after
        `timeout_s` end those still open with an error. Thread- and signal-safe."""
        self._draining = True
        if self._loop is not None and not self._loop.is_closed():
            message = (f"the server is shutting down: the request was still running "
                       f"{timeout_s:g} s after the stop signal (--shutdown-timeout)")
            self._loop.call_soon_threadsafe(self._loop.call_later, timeout_s, self._fail_all,
                                            message)

    @property
    def num_open_requests(self) -> int:
        return len(self._queues)

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        """The event loop the client runs in (None before start())."""
        return self._loop

    def begin_shutdown(self) -> None:
        """From a signal handler: end every open request now (an error event for streams), so
        uvicorn need not wait out its grace period for them. Thread- and signal-safe."""
        self._draining = True
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._fail_all, "the server is shutting down")

    def shutdown_sync(self) -> None:
        """For paths where the event loop never ran (start-up failed or was interrupted)."""
        if not self._closing:
            self._closing = True
            self.replicas.stop_sync()

    def close_sockets(self) -> None:
        """After shutdown_sync, outside the loop: close the ZMQ sockets."""
        self.replicas.close_sockets()

    @property
    def is_dead(self) -> bool:
        return self.dead_error is not None

    @property
    def health(self) -> str:
        """"ok" (every replica serves), "degraded" (some replica is down or restarting, at
        least one serves) or "dead" (none serves: the engine failed)."""
        if self.dead_error is not None:
            return "dead"
        if self.replicas_down:
            return "degraded" if self.router.serving else "restarting"
        return "ok"

    @property
    def replicas_down(self) -> list[int]:
        """Replicas that died and are being restarted (replica_recovery.py)."""
        return sorted(self.router.down)

    # ---- requests ----
    def check_alive(self) -> None:
        if self.dead_error is not None:
            raise EngineDeadError(self.dead_error)
        if self._closing or self._draining:
            raise EngineDeadError("the server is shutting down")

    def admit(self, num_engine_requests: int) -> None:
        """Refuse now (before any response starts) if dead, draining, or the wait is full."""
        self.check_alive()
        if self.max_queued is None:
            return
        batch = self.config.scheduler_config.max_num_seqs * len(self.router.serving)
        waiting = self._num_engine_requests - batch
        if max(waiting, 0) + num_engine_requests > self.max_queued:
            self.metrics.on_rejected("queue_full")
            raise QueueFullError(
                f"the engine's queue is full: {max(waiting, 0)} requests waiting, this one "
                f"adds {num_engine_requests}, the limit is {self.max_queued} "
                f"(--max-queued-requests); retry after {QueueFullError.retry_after_s} s"
            )

    async def generate(
        self, request_id: str, prompt: tuple[str | None, list[int]], params: SamplingParams,
        priority: int = 0, lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Cumulative RequestOutputs until finished. Leaving early (a disconnect, cancellation)
        aborts the request so its KV blocks are freed. `lora_request`'s adapter is loaded
        first (once per id; a refused one raises its ValueError here)."""
        self.check_alive()
        await self.loras.load([lora_request])
        queue = await self._add_request(request_id, prompt, params, priority, lora_request)
        self._num_engine_requests += params.n
        finished = False
        try:
            while not finished:
                item = await queue.get()
                finished = item.finished
                yield item
        finally:
            self._num_engine_requests -= params.n
            self._queues.pop(request_id, None)
            if not finished:
                await self.abort(request_id)

    async def _add_request(
        self, request_id: str, prompt: tuple[str | None, list[int]], params: SamplingParams,
        priority: int = 0, lora_request: LoRARequest | None = None,
    ) -> OutputCollector:
        req = self.inputs.process(request_id, prompt, params, priority, lora_request)
        ids, children = req.prompt_token_ids, req.children
        core_requests = req.core_requests()
        # First, as it may refuse (every replica asleep): nothing is registered then.
        replica = await self._assign([r.request_id for r in core_requests])
        queue = OutputCollector()
        self._queues[request_id] = queue
        self.processor.add_request(request_id, req.prompt, ids, children)
        self.metrics.on_request_added(list(children), len(ids))
        self._stats_log.tokens[0] += len(ids) * len(children)
        self.recovery.added(request_id)
        # Every child registered before the first send: a replica that dies meanwhile hands
        # them all back (replica_recovery.py), sent or not.
        self._core_requests.update((r.request_id, r) for r in core_requests)
        for core_request in core_requests:
            await self._send(replica, EngineRequest("add", request=core_request))
        return queue

    async def _assign(self, child_ids: list[str]) -> int:
        """The replica for a request; while every replica restarts, wait (bounded) for one."""
        try:
            return self.router.assign(child_ids)
        except NoReplicaUpError:
            await self.recovery.wait_for_replica()
            self.check_alive()
            return self.router.assign(child_ids)

    async def abort(self, request_id: str) -> None:
        child_ids = self.processor.child_ids(request_id)
        self.processor.abort(request_id)
        self.recovery.ended(request_id)
        self.metrics.on_finished(child_ids, "abort")
        await self._abort_children(child_ids)

    async def _abort_children(self, child_ids: list[str]) -> None:
        """Tell each owning replica; the ids stop counting as open either way."""
        for cid in child_ids:
            self._core_requests.pop(cid, None)
        owners = self.router.by_owner(child_ids)
        self.router.finished(child_ids)
        if self._closing or self.dead_error is not None:
            return
        for replica, ids in owners.items():
            await self._send(replica, EngineRequest("abort", request_ids=ids))

    async def _send(self, replica: int, msg: EngineRequest) -> None:
        """A send to a replica that dies meanwhile is dropped (its socket closed, the send
        cancelled): what it was sent is handed back by its take_down and moved on."""
        try:
            await self.replicas.send(replica, msg)
        except (asyncio.CancelledError, zmq.ZMQError, KeyError):
            task = asyncio.current_task()
            if replica not in self.router.down or (task is not None and task.cancelling()):
                raise

    # ---- replicas: re-scaling and utility calls ----
    async def scale(self, data_parallel_size: int) -> list[int]:
        """Serve with `data_parallel_size` replicas (see replica_set.py)."""
        self.check_alive()
        if self.replicas_down:
            raise ValueError(f"engine replicas {self.replicas_down} are restarting after a "
                             f"failure; re-scale once /health says ok")
        serving = await self.replicas.scale(data_parallel_size)
        self.metrics.set_replicas(len(serving), self.router.replicas)
        return serving

    async def call(self, method: str, *args: Any, replicas: list[int] | None = None
                   ) -> list[Any]:
        self.check_alive()
        return await self.replicas.call(method, *args, replicas=replicas)

    # ---- outputs ----
    async def _outputs_loop(self) -> None:
        try:
            while True:
                msg = await self.replicas.recv()
                if not self.replica_set.is_current(msg):
                    continue  # sent by a replica that died since (its requests moved on)
                self._handle(msg)
                for index in await self.replicas.retire_drained():
                    self.metrics.remove_replica(index)
                if msg.dead_error is not None:
                    self._replica_died(msg.engine_index, msg.dead_error,
                                       f"the engine died: {self._name(msg.engine_index)}")
                    if self.dead_error is not None:
                        return
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a bug here must not leave requests hanging
            logger.exception("engine outputs loop failed")
            self._mark_dead(f"the engine outputs loop failed: {e}")

    def _name(self, replica: int) -> str:
        return f"engine core {replica}: " if len(self.router.replicas) > 1 else ""

    def _handle(self, msg: EngineOutputs) -> None:
        self.router.on_stats(msg.engine_index, msg.stats)
        if msg.engine_index in self.router.stats:
            self.metrics.on_stats(msg.engine_index, msg.stats)
        if msg.utility is not None:
            self.replicas.on_utility(msg)
        done = [o.request_id for o in msg.outputs if o.finished]
        self.router.finished(done)
        for rid in done:
            self._core_requests.pop(rid, None)
        if not msg.outputs:
            return
        now = time.monotonic()
        self.metrics.on_outputs(msg.outputs, now)
        self._stats_log.tokens[1] += sum(len(o.new_token_ids) for o in msg.outputs)
        results, to_abort = self.processor.process(msg.outputs)
        if to_abort:  # stop strings, found during detokenization
            self.metrics.on_finished(to_abort, "stop")
            asyncio.get_running_loop().create_task(self._abort_children(to_abort))
        for out in results:
            if out.finished:
                self.recovery.ended(out.request_id)
            queue = self._queues.get(out.request_id)
            if queue is not None:
                queue.put(out)
        self.recovery.after_outputs()

    def _on_process_exit(self, proc: EngineCoreProcess) -> None:
        asyncio.get_running_loop().remove_reader(proc.sentinel)
        if self._closing or self.replica_set.group.procs.get(proc.engine_index) is not proc:
            return  # stopping, or a replica already taken down (its restart is under way)
        # describe_exit reaps it first (bounded), to name the status.
        self._replica_died(proc.engine_index, describe_exit(proc))

    def _replica_died(self, index: int, cause: str, prefix: str = "") -> None:
        if self._closing or self.dead_error is not None:
            return
        if not self.recovery.on_death(index, cause):
            bound = (f" (restart bound reached: {self.recovery.budget.describe()})"
                     if self.recovery.enabled else "")
            self._mark_dead(f"{prefix}{cause}{bound}")

    # ---- what replica recovery asks (replica_recovery.RecoveryHost) ----
    def core_request(self, child_id: str) -> EngineCoreRequest | None:
        return self._core_requests.get(child_id)

    def fail_request(self, parent_id: str, error: str) -> None:
        children = self.processor.child_ids(parent_id)
        for cid in children:
            self._core_requests.pop(cid, None)
        self.router.finished(children)
        self.processor.abort(parent_id)
        self.metrics.on_finished(children, "abort")
        self.recovery.ended(parent_id)
        if (queue := self._queues.get(parent_id)) is not None:
            queue.put(EngineDeadError(error))

    async def send_add(self, replica: int, request: EngineCoreRequest) -> None:
        await self._send(replica, EngineRequest("add", request=request))

    def mark_dead(self, error: str) -> None:
        self._mark_dead(error)

    def _mark_dead(self, error: str) -> None:
        first = self.dead_error is None and not self._closing
        if first:
            logger.error("%s; /health now reports 503", error)
            self.dead_error = error
        self._fail_all(error)
        self.replicas.fail_calls(EngineDeadError(error))
        if first and self.on_dead is not None:
            self.on_dead(error)

    def _fail_all(self, error: str) -> None:
        self.recovery.wake_waiters()  # requests waiting for a replica to come up
        for queue in self._queues.values():
            queue.put(EngineDeadError(error))
