"""Where the ranks run: a placement group (the caller's, or one made here and removed at
shutdown) with one bundle per rank, ordered driver node first, so that the driver node's ranks
are 0..n-1 and read the broadcast queue through shared memory (ray_v2).

    place_ranks ─▶ Placement (bundle, node, CPUs and GPUs of every rank) ─▶ remove_placement
"""

from __future__ import annotations

import logging
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

logger = logging.getLogger(__name__)


class RayPlacementError(RuntimeError):
    """The placement group could not be scheduled (or does not fit the ranks)."""


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
