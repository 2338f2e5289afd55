"""RayWorkerGroup: the worker actors of one engine, from placement to teardown.

    start(): connect_ray ─▶ place_ranks ─▶ one RayWorkerWrapper actor per rank (in its bundle)
             ─▶ rank 0 binds the rendezvous ─▶ init_worker on every rank (init_device, load_model)
    watch(refs): a thread waits on one long-running ref per actor; the first to finish (the
             actor died, or its loop ended) is reported once through `on_death(description)`
    stop():  stop watching ─▶ ray.kill every actor and wait until they are gone ─▶ remove the
             placement group we created ─▶ stop a Ray we started

Both Ray backends hold one; they differ only in how calls reach the workers. Also here: what
each actor is started with (its name, environment and thread count) and how its death reads.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from collections.abc import Callable
from typing import Any

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from shardserve.config import EngineConfig, ParallelConfig
from shardserve.errors import WorkerStartupError
from shardserve.executor.ray.actor import remote_worker_class
from shardserve.executor.ray.cluster import RayConnection, connect_ray, disconnect_ray
from shardserve.executor.ray.placement import Placement, place_ranks, remove_placement

logger = logging.getLogger(__name__)

_WATCH_POLL_S = 0.2  # a death is reported at most this long after Ray sees it
_KILL_WAIT_S = 5.0

DeathCallback = Callable[[str], None]  # gets describe(rank, reason)

# Set per worker by Ray or by the executor, never copied from the driver.
WORKER_SPECIFIC_ENV = frozenset(
    {"CUDA_VISIBLE_DEVICES", "LOCAL_RANK", "RANK", "WORLD_SIZE", "SHARDSERVE_HOST_IP"}
)
# Driver variables the workers need (debug knobs, model hub and tokenizer settings).
PROPAGATED_ENV_PREFIXES = ("SHARDSERVE_", "HF_", "HUGGINGFACE_", "TRANSFORMERS_", "TOKENIZERS_")


class RayWorkerGroup:
    def __init__(self, config: EngineConfig, on_death: DeathCallback) -> None:
        self.config = config
        self.pc = config.parallel_config
        self.instance_id = secrets.token_hex(4)
        self._on_death = on_death
        self.connection: RayConnection | None = None
        self.placement: Placement | None = None
        self.actors: list[Any] = []
        self.info: list[dict[str, Any]] = []
        self._watched: dict[Any, int] = {}  # long-running ref -> rank
        self.lifelines: dict[Any, int] = {}  # watch() refs: they end only when the actor does
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- start ----
    def start(self, timeout_s: float) -> None:
        self.connection = connect_ray(self.pc)
        self.placement = place_ranks(self.pc, self.config.device_config.device)
        self.actors = [self._create_actor(rank) for rank in range(self.pc.world_size)]
        self.lifelines = {a.watch.remote(): rank for rank, a in enumerate(self.actors)}
        deadline = time.monotonic() + timeout_s
        init_method = None
        if self.pc.world_size > 1:
            init_method = self._get([self.actors[0].create_rendezvous.remote()], deadline)[0]
        p = self.placement
        self._get(
            [
                actor.init_worker.remote(
                    p.local_rank(rank), len(p.ranks_on(p.nodes[rank])), init_method
                )
                for rank, actor in enumerate(self.actors)
            ],
            deadline,
        )  # fmt: skip
        self.info = self._get([a.info.remote() for a in self.actors], deadline)
        logger.info(
            "Ray workers: %s",
            ", ".join(f"rank {i['rank']} pid {i['pid']} on {i['node_ip']}" for i in self.info),
        )

    def _create_actor(self, rank: int) -> Any:
        p = self.placement
        assert p is not None
        # The actor takes exactly what its bundle holds (a caller's group may hold no CPU).
        cpus = p.cpus[rank]
        threads = threads_for(cpus or self.pc.ray.ray_cpus_per_worker)
        options: dict[str, Any] = dict(
            name=actor_name(self.instance_id, rank, self.pc),
            num_cpus=cpus,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                p.group, placement_group_bundle_index=p.bundles[rank]
            ),
            runtime_env={"env_vars": worker_env(threads)},
            max_restarts=0,  # a dead rank cannot rejoin the process group: fail instead
        )
        if p.gpus[rank]:
            options["num_gpus"] = p.gpus[rank]  # Ray sets CUDA_VISIBLE_DEVICES to its GPU
        output_rank = self.pc.layout.output_rank
        return (
            remote_worker_class()
            .options(**options)
            .remote(self.config, rank, threads, output_rank)
        )

    def _get(self, refs: list[Any], deadline: float) -> list[Any]:
        """ray.get of one ref per rank, surfacing the first failure at once (the other ranks
        may be blocked in the rendezvous waiting for the failed one)."""
        rank_of = {ref: rank for rank, ref in enumerate(refs)}
        pending = list(refs)
        while pending:
            remaining = deadline - time.monotonic()
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, remaining))
            if not ready:
                ranks = sorted(rank_of[r] for r in pending)
                raise WorkerStartupError(
                    f"worker ranks {ranks} did not report ready within "
                    f"{self.pc.worker_start_timeout_s:.0f} s; raise "
                    f"parallel_config.worker_start_timeout_s if loading is just slow"
                )
            try:
                ray.get(ready[0])
            except Exception as e:
                raise WorkerStartupError(
                    f"worker rank {rank_of[ready[0]]} failed during start-up: {e}"
                ) from e
        return ray.get(refs)

    # ---- death watch ----
    def watch(self, refs: dict[Any, int]) -> None:
        """Report the first of `refs` (one long-running call per rank) that finishes."""
        self._watched = refs
        self._thread = threading.Thread(
            target=self._watch_loop, name="shardserve-ray-monitor", daemon=True
        )
        self._thread.start()

    def _watch_loop(self) -> None:
        # Short bounded waits, not one blocking wait: stop() must be able to end this thread
        # before Ray is shut down underneath it.
        while not self._stop.is_set() and ray.is_initialized():
            try:
                dead = self.find_dead(_WATCH_POLL_S)
            except Exception as e:
                logger.warning("the Ray worker monitor stopped: %s", e)
                return
            if dead is not None and not self._stop.is_set():
                self._on_death(self.describe(*dead))
                return

    def report_dead(self, wait_s: float) -> None:
        """Look for a dead rank now (from a failing call's thread), waiting up to wait_s, and
        report it through the same callback as the watcher thread (which records it once)."""
        dead = self.find_dead(wait_s)
        if dead is not None:
            self._on_death(self.describe(*dead))

    def find_dead(self, wait_s: float) -> tuple[int, str] | None:
        """(rank, reason) of a watched call that has finished, waiting up to wait_s."""
        if not self._watched:
            return None
        ready, _ = ray.wait(list(self._watched), num_returns=1, timeout=wait_s)
        if not ready:
            return None
        try:
            ray.get(ready[0], timeout=1.0)
            reason = "its loop returned"
        except Exception as e:
            reason = describe_death(e)
        return self._watched[ready[0]], reason

    def describe(self, rank: int, reason: str) -> str:
        info = self.info[rank] if rank < len(self.info) else {}
        where = f"pid {info.get('pid', '?')} on node {info.get('node_ip', '?')}"
        return f"worker {self.pc.describe_rank(rank, where)} died unexpectedly ({reason})"

    # ---- stop ----
    def stop_watching(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def stop(self, grace_s: float = 0.0, graceful: list[Any] | None = None) -> None:
        """Kill the actors (after up to grace_s for the `graceful` calls to end by themselves),
        remove the placement group we created and stop a Ray we started. Idempotent."""
        self.stop_watching()
        if not ray.is_initialized():
            return
        if grace_s > 0 and graceful:
            ray.wait(graceful, num_returns=len(graceful), timeout=grace_s)
        self.kill_actors()
        self.actors = []
        remove_placement(self.placement)
        self.placement = None
        disconnect_ray(self.connection)
        self.connection = None

    def kill_actors(self) -> None:
        """ray.kill every actor and wait until they are gone. Idempotent."""
        for actor in self.actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception as e:
                logger.warning("could not kill a worker actor: %s", e)
        self._wait_gone()

    def _wait_gone(self) -> None:
        """Block until every killed actor has exited (so nothing is left when we return)."""
        refs = list(self.lifelines)
        if refs:
            _, alive = ray.wait(refs, num_returns=len(refs), timeout=_KILL_WAIT_S)
            if alive:
                ranks = sorted(self.lifelines[r] for r in alive)
                logger.warning(
                    "worker ranks %s still alive %.0f s after ray.kill", ranks, _KILL_WAIT_S
                )


# ---- what an actor is started with, and how its death reads -----------------------------------
def actor_name(instance_id: str, rank: int, pc: ParallelConfig) -> str:
    """`shardserve_<instance>_TP<r>[_PCP<c>][_PP<s>]`: predictable, unique per engine
    instance."""
    where = pc.layout.coords(rank)
    name = f"shardserve_{instance_id}_TP{where.tp}"
    if pc.prefill_context_parallel_size > 1:
        name += f"_PCP{where.pcp}"
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
