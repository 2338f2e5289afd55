"""Joining Ray, and leaving it as found: connect_ray joins the configured cluster, keeps an
already-initialised Ray, or starts a local one; disconnect_ray undoes exactly what connect_ray did
(a local Ray it started is stopped, and the semaphores its raylet leaves in /dev/shm removed).
Used by both Ray backends and by the engine's Ray data-parallel launcher.
"""

from __future__ import annotations

import contextlib
import glob
import logging
import os
import time
from dataclasses import dataclass

import ray

from shardserve.config import ParallelConfig
from shardserve.ipc.wakeup import process_alive

logger = logging.getLogger(__name__)


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
        raylets = raylet_pids() if conn.started_local else []
        ray.shutdown()
        for pid in raylets:
            remove_raylet_semaphores(pid)


def raylet_pids() -> list[int]:
    """The pids of the raylets of the Ray this process started (empty if unknown)."""
    try:
        node = ray._private.worker._global_node
        return [p.process.pid for p in node.all_processes.get("raylet", [])]
    except Exception:  # a private API: never let it break a shutdown
        return []


def remove_raylet_semaphores(pid: int) -> None:
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
