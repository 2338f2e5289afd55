"""EngineCoreClient: what a synchronous front end (LLMEngine, so `LLM`) needs of its engine
cores, with two implementations:

* `InprocClient`: one EngineCore in this process (data_parallel_size=1): `get_output()` is one
  `EngineCore.step()`, nothing crosses a process boundary.
* `MPClient` (mp_client.py): `data_parallel_size` engine cores, each in its own process with
  its own executor (core_proc.py, the process the API server runs too), over ZMQ: typed
  `EngineRequest`s out, `EngineOutputs` back. Requests go to the least loaded replica
  (dp_router.py); replicas can be added and removed while serving.

The asyncio front end (the API server, AsyncLLM) is server/async_engine.py over the same
processes and messages.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from typing import Any

from shardserve.config import EngineConfig
from shardserve.engine.core import EngineCore
from shardserve.engine.core_proc import (
    UTILITY_METHODS,
    SchedulerStats,
    scheduler_stats,
)
from shardserve.engine.input_processor import EngineCoreRequest
from shardserve.messages import EngineCoreOutput

logger = logging.getLogger(__name__)

# How often a wait for outputs re-checks that every engine process is alive.
_POLL_MS = 100


class EngineCoreClient(ABC):
    @abstractmethod
    def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        """Queue one request's children (they go to the same engine core)."""

    @abstractmethod
    def abort_requests(self, request_ids: list[str]) -> None: ...

    @abstractmethod
    def get_output(self) -> list[EngineCoreOutput]:
        """The next outputs (maybe none: call again while requests are unfinished); raises
        EngineDeadError when an engine core has died."""

    @abstractmethod
    def has_unfinished_requests(self) -> bool: ...

    @abstractmethod
    def stats(self) -> list[SchedulerStats]:
        """Each engine core's latest figures, by replica index."""

    @abstractmethod
    def call(self, method: str, *args: Any, replicas: list[int] | None = None) -> list[Any]:
        """Run an engine-core method (core_proc.UTILITY_METHODS) on each replica (default all)
        and return their results in replica order; the first failure raises RuntimeError."""

    @abstractmethod
    def scale(self, data_parallel_size: int) -> None:
        """Add or remove replicas (see mp_client.py); a replica being removed finishes the
        requests it runs first."""

    @abstractmethod
    def shutdown(self) -> None:
        """Idempotent: stop the engine cores and free what this client created."""


def make_client(config: EngineConfig) -> EngineCoreClient:
    if config.parallel_config.data_parallel_size == 1:
        return InprocClient(config)
    from shardserve.engine.mp_client import MPClient

    return MPClient(config)


class InprocClient(EngineCoreClient):
    def __init__(self, config: EngineConfig) -> None:
        self.core = EngineCore(config)

    def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        for request in requests:
            self.core.add_request(request.to_request())

    def abort_requests(self, request_ids: list[str]) -> None:
        self.core.abort_requests(request_ids)

    def get_output(self) -> list[EngineCoreOutput]:
        return self.core.step()

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def stats(self) -> list[SchedulerStats]:
        return [scheduler_stats(self.core)]

    def call(self, method: str, *args: Any, replicas: list[int] | None = None) -> list[Any]:
        if method not in UTILITY_METHODS:
            raise ValueError(f"{method!r} is not one of {sorted(UTILITY_METHODS)}")
        if replicas not in (None, [0]):
            raise ValueError(f"replicas={replicas}: there is one engine core (replica 0)")
        if method == "collective_rpc":
            return [self.core.executor.collective_rpc(*args)]
        return [getattr(self.core, method)(*args)]

    def scale(self, data_parallel_size: int) -> None:
        if data_parallel_size != 1:  # LLM.scale switches to MPClient instead
            raise ValueError("an in-process engine core is one replica")

    def shutdown(self) -> None:
        self.core.shutdown()
