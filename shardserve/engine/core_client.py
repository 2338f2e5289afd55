"""EngineCoreClient: what a synchronous front end (LLMEngine, so `LLM`) needs of its engine
cores, with two implementations:

* `InprocClient` (inproc_client.py): one EngineCore in this process (data_parallel_size=1):
  `get_output()` is one `EngineCore.step()`, nothing crosses a process boundary.
* `MPClient` (mp_client.py): `data_parallel_size` engine cores, each in its own process with
  its own executor (core_proc.py, the process the API server runs too), over ZMQ
  (core_wire.py): typed `EngineRequest`s out, `EngineOutputs` back. Requests go to the least
  loaded replica (dp_router.py); replicas can be added and removed while serving
  (replica_set.py).

The asyncio front end (the API server, AsyncLLM) is async_engine.py over AsyncMPClient
(async_mp_client.py): the same processes, messages and replica set.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from shardserve.engine.core_wire import SchedulerStats
from shardserve.engine.input_processor import EngineCoreRequest
from shardserve.messages import EngineCoreOutput


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

    @property
    @abstractmethod
    def num_replicas(self) -> int:
        """Engine cores it runs (data-parallel replicas, a draining one included)."""

    @abstractmethod
    def stats(self) -> list[SchedulerStats]:
        """Each engine core's latest figures, by replica index."""

    @abstractmethod
    def call(self, method: str, *args: Any, replicas: list[int] | None = None) -> list[Any]:
        """Run an engine-core method (core_wire.UTILITY_METHODS) on each replica (default all)
        and return their results in replica order; the first failure raises RuntimeError."""

    @abstractmethod
    def scale(self, data_parallel_size: int) -> EngineCoreClient:
        """Serve with `data_parallel_size` replicas from now on, and return the client that
        does: this one (replicas added, or removed once they finish the requests they run:
        replica_set.py), or a new one that replaces it (the in-process core moves to engine
        processes; this one is then shut down)."""

    @abstractmethod
    def shutdown(self) -> None:
        """Idempotent: stop the engine cores and free what this client created."""
