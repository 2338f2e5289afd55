"""build_worker: the one way a backend makes a rank's worker, whatever hosts it (the caller's
thread for uni and external_launcher, a worker process for mp and the other nodes' ranks, a Ray
actor for ray and ray_v2).

The class is `parallel_config.worker_cls` (a dotted path; the default is Worker), so a user's
subclass, with methods of its own for collective_rpc, runs on every backend alike.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from shardserve.config import EngineConfig
from shardserve.worker.worker import Worker


def worker_class(dotted: str) -> type[Worker]:
    """The class named by `module.Class` (imported here: a worker process imports it anew)."""
    module, _, name = dotted.rpartition(".")
    return getattr(importlib.import_module(module), name)


def build_worker(
    config: EngineConfig,
    rank: int = 0,
    local_rank: int = 0,
    distributed_init_method: str | None = None,
    local_world_size: int | None = None,
    after_init_device: Callable[[Worker], None] | None = None,
) -> Worker:
    """A rank's worker of class `parallel_config.worker_cls`, with its device
    initialised (a multi-rank worker joins its process groups there) and its model loaded.

    after_init_device: run between the two (Ray sets the actor's torch thread count there,
    which init_device would otherwise override, before the model loads)."""
    cls = worker_class(config.parallel_config.worker_cls)
    worker = cls(
        config,
        rank=rank,
        local_rank=local_rank,
        distributed_init_method=distributed_init_method,
        local_world_size=local_world_size,
    )
    worker.init_device()
    if after_init_device is not None:
        after_init_device(worker)
    worker.load_model()
    return worker
