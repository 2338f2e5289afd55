"""Ray plumbing shared by both Ray backends: cluster, placement, naming, environment.

    connect_ray ──▶ place_ranks (placement group, bundles ordered driver node first)
                    ──▶ RayWorkerGroup (ray_workers.py): one RayWorkerWrapper actor per rank

Only the Ray backends import this module; shardserve itself imports without Ray.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ray
import torch
from ray.util.placement_group import (
    PlacementGroup,
    get_current_placement_group,
    get_placement_group,
    placement_group,
    placement_group_table,
    remove_placement_group,
)

from shardserve import envs
from shardserve.config import EngineConfig, ParallelConfig
from shardserve.engine.messages import GrammarOutput, SchedulerOutput
from shardserve.executor.rpc import RemoteError
from shardserve.ipc import Handle, MessageQueue
from shardserve.worker.worker import run_method
from shardserve.worker.worker_main import ATTACH_TIMEOUT_S, run_busy_loop

logger = logging.getLogger(__name__)

# Set per worker by Ray or by the executor, never copied from the driver.
WORKER_SPECIFIC_ENV = frozenset(
    {"CUDA_VISIBLE_DEVICES", "LOCAL_RANK", "RANK", "WORLD_SIZE", "SHARDSERVE_HOST_IP"}
)
# Driver variables the workers need (debug knobs, model hub and tokenizer settings).
PROPAGATED_ENV_PREFIXES = ("SHARDSERVE_", "HF_", "HUGGINGFACE_", "TRANSFORMERS_", "TOKENIZERS_")


class RayPlacementError(RuntimeError):
    """The placement group could not be scheduled (or does not fit the ranks)."""


# ---- cluster ----------------------------------------------------------------------------------
@dataclass
class RayConnection:
    """What connect_ray did, so that disconnect_ray undoes exactly that and no more."""

    initialized_here: bool  # we called ray.init (so we call ray.shutdown)
    started_local: bool  # ... and that started a local Ray (stopped by ray.shutdown)


def connect_ray(pc: ParallelConfig) -> RayConnection:
    """Join the configured cluster, keep an already-initialised Ray, or start a local one."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if ray.is_initialized():
        return RayConnection(initialized_here=False, started_local=False)
    address = pc.ray_address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=True)
        return RayConnection(initialized_here=True, started_local=False)
    # "local" always starts a new instance instead of joining one found on this machine, so
    # stopping it at shutdown cannot take down a cluster somebody else started.
    ray.init(address="local", include_dashboard=False)
    logger.info("started a local Ray instance (stopped at shutdown)")
    return RayConnection(initialized_here=True, started_local=True)


def disconnect_ray(conn: RayConnection | None) -> None:
    if conn is not None and conn.initialized_here and ray.is_initialized():
        ray.shutdown()


# ---- placement --------------------------------------------------------------------------------
@dataclass
class Placement:
    """Where each rank runs: rank r uses bundle `bundles[r]` on node `nodes[r]`."""

    group: PlacementGroup
    created_here: bool  # we remove it at shutdown
    bundles: list[int]
    nodes: list[str]
    node_ips: list[str]
    cpus: list[float]  # logical CPUs in each rank's bundle
    gpus: list[float]
    driver_node: str
    specs: list[dict[str, float]] = field(default_factory=list)

    def ranks_on(self, node: str) -> list[int]:
        return [r for r, n in enumerate(self.nodes) if n == node]

    def local_rank(self, rank: int) -> int:
        """Index of `rank` among the ranks on its node."""
        return self.ranks_on(self.nodes[rank]).index(rank)


def bundle_specs(pc: ParallelConfig, device: str) -> list[dict[str, float]]:
    spec: dict[str, float] = {"CPU": float(pc.ray_cpus_per_worker)}
    if device == "cuda":
        spec["GPU"] = 1.0
    spec.update(pc.ray_bundle_resources or {})
    return [dict(spec) for _ in range(pc.world_size)]


def place_ranks(pc: ParallelConfig, device: str) -> Placement:
    """A placement group for the ranks (the caller's, or a new one), ready, ordered by node."""
    group, created = _existing_group(pc), False
    specs = bundle_specs(pc, device)
    if group is None:
        group, created = placement_group(specs, strategy=pc.ray_placement_strategy), True
    try:
        _wait_ready(group, specs, pc, created)
        return _order_by_node(group, created, pc.world_size, specs)
    except BaseException:
        if created:
            remove_placement_group(group)
        raise


def _existing_group(pc: ParallelConfig) -> PlacementGroup | None:
    if pc.ray_placement_group is not None:
        try:
            return get_placement_group(pc.ray_placement_group)
        except ValueError as e:
            raise RayPlacementError(
                f"ray_placement_group={pc.ray_placement_group!r}: no such placement group ({e})"
            ) from e
    return get_current_placement_group()


def _wait_ready(
    group: PlacementGroup, specs: list[dict[str, float]], pc: ParallelConfig, created: bool
) -> None:
    timeout_s = pc.ray_placement_timeout_s
    start = time.monotonic()
    # Bounded slices only so that a long wait says what it waits for in the log.
    while not group.wait(timeout_seconds=min(10.0, max(0.0, timeout_s))):
        waited = time.monotonic() - start
        if waited >= timeout_s:
            strategy = pc.ray_placement_strategy if created else "(the caller's group)"
            raise RayPlacementError(
                describe_unplaceable(specs, strategy, waited)
                + "; raise parallel_config.ray_placement_timeout_s if the cluster is just busy"
            )
        logger.info("waiting %.0f s for a placement group of %s", waited, specs)
        timeout_s = pc.ray_placement_timeout_s - waited


def describe_unplaceable(specs: list[dict[str, float]], strategy: str, waited_s: float) -> str:
    """The bundles asked for, the strategy, and the free resources of every alive node."""
    try:
        free = ray._private.state.available_resources_per_node()
    except Exception:  # a private API: degrade to totals rather than hide the real error
        free = {}
    lines = []
    for node in ray.nodes():
        if not node.get("Alive"):
            continue
        node_id = node["NodeID"]
        resources = free.get(node_id, node.get("Resources", {}))
        label = "free" if node_id in free else "total"
        lines.append(
            f"  node {node_id[:12]} ({node.get('NodeManagerAddress')}) {label}: "
            f"{_format_resources(resources)}"
        )
    return (
        f"placement group not ready after {waited_s:.1f} s: asked for {len(specs)} bundles "
        f"{specs} with strategy {strategy}; nodes:\n" + "\n".join(lines)
    )


def _format_resources(resources: dict[str, float]) -> str:
    shown = []
    for key, value in sorted(resources.items()):
        if key.startswith("node:") or key.startswith("accelerator_type"):
            continue
        if key in ("memory", "object_store_memory"):
            shown.append(f"{key}={value / 2**30:.1f}GiB")
        else:
            shown.append(f"{key}={value:g}")
    return "{" + ", ".join(shown) + "}"


def _order_by_node(
    group: PlacementGroup, created: bool, world: int, specs: list[dict[str, float]]
) -> Placement:
    table = placement_group_table(group)
    to_node: dict[int, str] = table["bundles_to_node_id"]
    held = table["bundles"]
    if len(to_node) < world:
        raise RayPlacementError(
            f"the placement group has {len(to_node)} bundles but {world} ranks need one each"
        )
    driver = ray.get_runtime_context().get_node_id()
    # The driver's node first (its ranks then read the broadcast through shared memory and
    # take ranks 0..n-1), then node by node; bundle order is kept within a node.
    first = sorted(range(len(to_node)), key=lambda b: (to_node[b] != driver, to_node[b]))[:world]
    ips = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
    nodes = [to_node[b] for b in first]
    return Placement(
        group,
        created,
        bundles=first,
        nodes=nodes,
        node_ips=[ips.get(n, "?") for n in nodes],
        cpus=[float(held[b].get("CPU", 0.0)) for b in first],
        gpus=[float(held[b].get("GPU", 0.0)) for b in first],
        driver_node=driver,
        specs=specs if created else [held[b] for b in first],
    )


def remove_placement(placement: Placement | None) -> None:
    if placement is not None and placement.created_here:
        try:
            remove_placement_group(placement.group)
        except Exception as e:  # Ray already gone: nothing is left to remove
            logger.warning("could not remove the placement group: %s", e)


# ---- naming and environment -------------------------------------------------------------------
def actor_name(instance_id: str, rank: int, pc: ParallelConfig) -> str:
    """`shardserve_<instance>_TP<r>[_PP<s>]`: predictable, unique per engine instance."""
    tp = pc.tensor_parallel_size
    name = f"shardserve_{instance_id}_TP{rank % tp}"
    if pc.pipeline_parallel_size > 1:
        name += f"_PP{rank // tp}"
    return name


def worker_env(threads: int) -> dict[str, str]:
    """Environment for a worker actor: the driver's relevant variables, minus per-worker ones,
    plus the thread count (set before torch is imported, so every thread of the actor,
    including the compiled graph's, starts with it)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k.startswith(PROPAGATED_ENV_PREFIXES) and k not in WORKER_SPECIFIC_ENV
    }
    env["OMP_NUM_THREADS"] = str(threads)
    return env


def threads_for(cpus: float) -> int:
    """Torch threads for a rank: the CPUs its bundle reserved (Ray's own OMP convention)."""
    return max(1, int(cpus))


def describe_death(error: BaseException) -> str:
    """Why an actor died, from Ray's error (which reads 'The actor is dead because ...')."""
    for line in str(error).splitlines():
        if "because" in line:
            return line.strip().rstrip(".")
    return type(error).__name__


# ---- the actor --------------------------------------------------------------------------------
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
        self._replies: MessageQueue | None = None
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

    def init_worker(
        self, local_rank: int, local_world_size: int, init_method: str | None, worker_cls: str
    ) -> None:
        module, _, name = worker_cls.rpartition(".")
        cls = getattr(importlib.import_module(module), name)
        self.worker = cls(
            self.config,
            rank=self.rank,
            local_rank=local_rank,
            distributed_init_method=init_method,
            local_world_size=local_world_size,
        )
        self.worker.init_device()
        self._set_threads()
        self.worker.load_model()

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
        self._set_threads()
        scheduler_output, grammar_output = inputs
        try:
            self.worker.execute_model(scheduler_output)
            output = self.worker.sample_tokens(grammar_output)
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
        self._replies = MessageQueue(
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
            broadcast = MessageQueue.create_from_handle(
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
