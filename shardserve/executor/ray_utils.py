"""Ray plumbing shared by both Ray backends: cluster, placement, naming, environment.

    connect_ray ──▶ place_ranks (placement group, bundles ordered driver node first)
                    ──▶ RayWorkerGroup (ray_workers.py): one RayWorkerWrapper actor per rank

The actor class, RayWorkerWrapper, lives in ray_wrapper.py and is re-exported here. Only the
Ray backends import this module; shardserve itself imports without Ray.
"""

from __future__ import annotations

import contextlib
import glob
import logging
import os
import time
from dataclasses import dataclass, field

import ray
from ray.util.placement_group import (
    PlacementGroup,
    get_current_placement_group,
    get_placement_group,
    placement_group,
    placement_group_table,
    remove_placement_group,
)

from shardserve.config import ParallelConfig
from shardserve.executor.ray_wrapper import RayWorkerWrapper, RemoteFailure, remote_worker_class
from shardserve.ipc.wakeup import process_alive

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
    address = pc.ray.ray_address or os.environ.get("RAY_ADDRESS")
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
        raylets = _raylet_pids() if conn.started_local else []
        ray.shutdown()
        for pid in raylets:
            _remove_raylet_semaphores(pid)


def _raylet_pids() -> list[int]:
    """The pids of the raylets of the Ray this process started (empty if unknown)."""
    try:
        node = ray._private.worker._global_node
        return [p.process.pid for p in node.all_processes.get("raylet", [])]
    except Exception:  # a private API: never let it break a shutdown
        return []


def _remove_raylet_semaphores(pid: int) -> None:
    """Ray's raylet names a compiled graph's channel semaphores sem.obj<pid>-* / sem.hdr<pid>-*
    in /dev/shm and leaves those of actor-to-actor channels (pipeline stages) behind when it
    stops. Once the raylet of a Ray we started has exited nobody can use them: remove them."""
    deadline = time.monotonic() + 2.0  # ray.shutdown() has signalled it; it exits at once
    while process_alive(pid, 0) and time.monotonic() < deadline:
        time.sleep(0.02)
    if process_alive(pid, 0):
        return
    for path in glob.glob(f"/dev/shm/sem.obj{pid}-*") + glob.glob(f"/dev/shm/sem.hdr{pid}-*"):
        with contextlib.suppress(OSError):
            os.unlink(path)


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
    spec: dict[str, float] = {"CPU": float(pc.ray.ray_cpus_per_worker)}
    if device == "cuda":
        spec["GPU"] = 1.0
    spec.update(pc.ray.ray_bundle_resources or {})
    return [dict(spec) for _ in range(pc.world_size)]


def place_ranks(pc: ParallelConfig, device: str) -> Placement:
    """A placement group for the ranks (the caller's, or a new one), ready, ordered by node."""
    group, created = _existing_group(pc), False
    specs = bundle_specs(pc, device)
    if group is None:
        group, created = placement_group(specs, strategy=pc.ray.ray_placement_strategy), True
    try:
        _wait_ready(group, specs, pc, created)
        return _order_by_node(group, created, pc.world_size, specs)
    except BaseException:
        if created:
            remove_placement_group(group)
        raise


def _existing_group(pc: ParallelConfig) -> PlacementGroup | None:
    if pc.ray.ray_placement_group is not None:
        try:
            return get_placement_group(pc.ray.ray_placement_group)
        except ValueError as e:
            raise RayPlacementError(
                f"ray_placement_group={pc.ray.ray_placement_group!r}: no such placement group ({e})"
            ) from e
    return get_current_placement_group()


def _wait_ready(
    group: PlacementGroup, specs: list[dict[str, float]], pc: ParallelConfig, created: bool
) -> None:
    timeout_s = pc.ray.ray_placement_timeout_s
    start = time.monotonic()
    # Bounded slices only so that a long wait says what it waits for in the log.
    while not group.wait(timeout_seconds=min(10.0, max(0.0, timeout_s))):
        waited = time.monotonic() - start
        if waited >= timeout_s:
            strategy = pc.ray.ray_placement_strategy if created else "(the caller's group)"
            raise RayPlacementError(
                describe_unplaceable(specs, strategy, waited)
                + "; raise parallel_config.ray.ray_placement_timeout_s if the cluster is just busy"
            )
        logger.info("waiting %.0f s for a placement group of %s", waited, specs)
        timeout_s = pc.ray.ray_placement_timeout_s - waited


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
    where = pc.layout.coords(rank)
    name = f"shardserve_{instance_id}_TP{where.tp}"
    if pc.pipeline_parallel_size > 1:
        name += f"_PP{where.pp}"
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


__all__ = [
    "Placement",
    "RayConnection",
    "RayPlacementError",
    "RayWorkerWrapper",
    "RemoteFailure",
    "actor_name",
    "bundle_specs",
    "connect_ray",
    "describe_death",
    "describe_unplaceable",
    "disconnect_ray",
    "place_ranks",
    "remote_worker_class",
    "remove_placement",
    "threads_for",
    "worker_env",
]
