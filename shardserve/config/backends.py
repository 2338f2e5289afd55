"""The executor backends by name: one table for the factory (executor/abstract.py) and for
the configs' validation. Each module is imported only when chosen (Ray stays optional)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Backend:
    name: str
    module: str
    cls: str
    supports_pp: bool
    """Runs several pipeline stages (needs a process per rank)."""
    multi_rank: bool
    """Runs more than one rank."""
    supports_cp: bool
    """Runs context parallelism (decode or prefill): the ranks of a CP group exchange K/V and
    partial attention, so it needs a process per rank."""


BACKENDS: dict[str, Backend] = {b.name: b for b in (
    Backend("uni", "shardserve.executor.uniproc", "UniProcExecutor",
            supports_pp=False, multi_rank=False, supports_cp=False),
    Backend("mp", "shardserve.executor.multiproc", "MultiprocExecutor",
            supports_pp=True, multi_rank=True, supports_cp=True),
    Backend("ray", "shardserve.executor.ray.distributed_executor", "RayDistributedExecutor",
            supports_pp=True, multi_rank=True, supports_cp=True),
    Backend("ray_v2", "shardserve.executor.ray.executor_v2", "RayExecutorV2",
            supports_pp=True, multi_rank=True, supports_cp=True),
    Backend("external_launcher", "shardserve.executor.external_launcher",
            "ExternalLauncherExecutor", supports_pp=True, multi_rank=True, supports_cp=True),
)}
PP_BACKENDS = tuple(name for name, b in BACKENDS.items() if b.supports_pp)
CP_BACKENDS = tuple(name for name, b in BACKENDS.items() if b.supports_cp)


def backend_of_class(module: str, qualname: str) -> Backend | None:
    """The table's entry for a built-in executor class (None for a user's own)."""
    return next((b for b in BACKENDS.values() if (b.module, b.cls) == (module, qualname)), None)
