"""RayWorkerWrapper: the Ray actor class hosting one rank's Worker (both Ray backends).

    RayWorkerGroup ──init_worker──▶ build_worker (worker_cls: init_device, load_model)
    ray:    actor.call() / execute_step() (actor calls or compiled-graph nodes)
    ray_v2: open_reply_queue(), then run(): worker_main.run_busy_loop over MessageQueues

Runs inside the actor's process: it imports nothing of the executor, only the worker layer.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ray
import torch

from shardserve import envs
from shardserve.config import EngineConfig
from shardserve.errors import RemoteError
from shardserve.ipc import Handle, MessageQueueReader, MessageQueueWriter
from shardserve.messages import GrammarOutput, SchedulerOutput
from shardserve.worker.build import build_worker
from shardserve.worker.worker import run_method
from shardserve.worker.worker_main import ATTACH_TIMEOUT_S, run_busy_loop


@dataclass
class RemoteFailure:
    """Returned (not raised) by an actor method whose worker call failed: the executor rebuilds
    the exception with rank, pid and remote traceback, as the mp backend does, and a compiled
    graph keeps running."""

    error: RemoteError
    failed_at: float = field(default_factory=time.time)  # the earliest failure is the cause


class RayWorkerWrapper:
    """Hosts one rank's Worker (the class every backend runs) inside a Ray actor.

    Default concurrency group, one thread, calls in submission order: init_worker, call,
    execute_step, and for ray_v2 the long-running run(). The "watch" group has threads of its
    own, so it answers while the default group is busy: watch() returns only when the actor
    exits (its ref fails the moment the actor dies), next_failure() when a step fails here,
    and info() reports where the rank runs.
    """

    def __init__(self, config: EngineConfig, rank: int, threads: int, output_rank: int) -> None:
        self.config = config
        self.rank = rank
        self.threads = threads
        self.output_rank = output_rank
        self.label = f"Worker_TP{rank}"
        self.worker: Any = None
        self._store: Any = None  # rank 0 keeps the rendezvous store alive
        self._stop = threading.Event()
        self._failed = threading.Event()
        self._failure: RemoteFailure | None = None
        self._broadcast_handle: Handle | None = None
        self._replies: MessageQueueWriter | None = None
        self._transport = "actor calls"
        logging.basicConfig(
            level=envs.log_level(),
            format=f"({self.label}) %(levelname)s %(name)s: %(message)s",
            force=True,
        )

    def create_rendezvous(self) -> str:
        """Rank 0: bind the torch.distributed store on this node (port chosen by the OS, so no
        other process can take it in between) and return its tcp:// address."""
        from torch.distributed import TCPStore

        ip = ray.util.get_node_ip_address()
        self._store = TCPStore(ip, 0, None, True, wait_for_workers=False, multi_tenant=True)
        return f"tcp://{ip}:{self._store.port}"

    def init_worker(self, local_rank: int, local_world_size: int, init_method: str | None) -> None:
        """Build this rank's worker (parallel_config.worker_cls), with the actor's thread count
        while it loads."""
        self.worker = build_worker(
            self.config, self.rank, local_rank, init_method, local_world_size,
            after_init_device=lambda _: self._set_threads(),
        )  # fmt: skip

    def _set_threads(self) -> None:
        # torch's intra-op setting is per OS thread (OpenMP); the compiled graph calls us from
        # a thread of its own, so every entry point re-applies it (cheap when unchanged).
        wanted = envs.num_threads() or self.threads
        if torch.get_num_threads() != wanted:
            torch.set_num_threads(wanted)

    def call(self, method: str | Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        try:
            return run_method(self.worker, method, args, kwargs)
        except Exception as e:
            return RemoteFailure(RemoteError.capture(self.rank, os.getpid(), e))

    def execute_step(self, inputs: tuple[SchedulerOutput, GrammarOutput | None]) -> Any:
        """One model step (execute_model then sample_tokens): one call or graph node per rank.
        Only the output rank returns its ModelRunnerOutput; the others return None."""
        return self._step(inputs, graph_handoff=False, intermediate=None)

    def execute_stage(
        self, inputs: tuple[SchedulerOutput, GrammarOutput | None], intermediate: Any = None
    ) -> Any:
        """A pipeline stage's node of a compiled graph: `intermediate` is the previous stage's
        (hidden, residual) pair, read from the graph's channel (None on the first stage); a
        stage before the last returns its own pair for the next stage's node, the last stage
        returns as execute_step does. A failure upstream passes through untouched."""
        if isinstance(intermediate, RemoteFailure):
            return intermediate
        return self._step(inputs, graph_handoff=True, intermediate=intermediate)

    def _step(
        self, inputs: tuple[SchedulerOutput, GrammarOutput | None], graph_handoff: bool,
        intermediate: Any,
    ) -> Any:
        self._set_threads()
        scheduler_output, grammar_output = inputs
        try:
            runner = self.worker.model_runner
            if graph_handoff and runner is not None:
                runner.graph_handoff, runner.inbound = True, intermediate
            self.worker.execute_model(scheduler_output)
            output = self.worker.sample_tokens(grammar_output)
            if graph_handoff and runner is not None and self.rank < self.output_rank:
                return runner.take_outbound()
        except Exception as e:
            failure = RemoteFailure(RemoteError.capture(self.rank, os.getpid(), e))
            # Peers may now wait for us in a collective for ever, and a compiled graph
            # returns only once every rank has: report through the watch group too.
            self._failure = failure
            self._failed.set()
            return failure
        return output if self.rank == self.output_rank else None

    # ---- ray_v2: the same busy loop as the mp backend, fed by the MessageQueue ----
    def open_reply_queue(self, broadcast: Handle, on_driver_node: bool) -> Handle:
        """Create this rank's reply queue: shared memory when the driver shares our node, TCP
        otherwise. Attaching to the broadcast waits for run() (see RayExecutorV2)."""
        self._broadcast_handle = broadcast
        self._replies = MessageQueueWriter(
            1,
            1 if on_driver_node else 0,
            connect_ip=ray.util.get_node_ip_address(),
            name=f"{self.label}-reply",
        )
        return self._replies.export_handle()

    def run(self) -> None:
        """Serve RpcRequests until shutdown; the executor watches this call's ref for death."""
        assert self._broadcast_handle is not None and self._replies is not None
        handle, broadcast = self._broadcast_handle, None
        local = self.rank < handle.n_local_reader
        self._transport = "shared memory" if local else "tcp"
        try:
            broadcast = MessageQueueReader.from_handle(
                handle, self.rank, name=f"{self.label}-bcast"
            )
            broadcast.wait_until_ready(timeout=ATTACH_TIMEOUT_S)
            self._replies.wait_until_ready(timeout=ATTACH_TIMEOUT_S)
            run_busy_loop(self.worker, self.rank, broadcast, self._replies)
        finally:
            for mq in (broadcast, self._replies):
                if mq is not None:
                    mq.close()
            if self.worker is not None:
                self.worker.shutdown()

    # ---- the "watch" group ----
    @ray.method(concurrency_group="watch")
    def watch(self) -> None:
        self._stop.wait()

    @ray.method(concurrency_group="watch")
    def next_failure(self) -> RemoteFailure | None:
        """Returns once a model step has failed here (compiled graph: see the executor)."""
        self._failed.wait()
        return self._failure

    @ray.method(concurrency_group="watch")
    def info(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "pid": os.getpid(),
            "node_id": ray.get_runtime_context().get_node_id(),
            "node_ip": ray.util.get_node_ip_address(),
            "broadcast": self._transport,
            "torch_threads": torch.get_num_threads(),
        }


@functools.cache
def remote_worker_class() -> Any:
    """RayWorkerWrapper as a Ray actor class (built once per process)."""
    return ray.remote(concurrency_groups={"watch": 3})(RayWorkerWrapper)
