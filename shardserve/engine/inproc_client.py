"""InprocClient: one EngineCore in this process (data_parallel_size=1), and `make_client`, which
picks it or MPClient for a config.

Scaling an in-process engine to more replicas moves it to engine processes: an MPClient is
started with the new size (the model is loaded again there), so the engine must be idle; the
in-process core is shut down only once the new client runs, so a failure keeps it.
"""

from __future__ import annotations

from typing import Any

from shardserve.config import EngineConfig
from shardserve.engine.core import EngineCore
from shardserve.engine.core_client import EngineCoreClient
from shardserve.engine.core_wire import UTILITY_METHODS, SchedulerStats, scheduler_stats
from shardserve.engine.dp_router import check_new_size, resized
from shardserve.engine.input_processor import EngineCoreRequest
from shardserve.engine.mp_client import MPClient
from shardserve.messages import EngineCoreOutput


def make_client(config: EngineConfig) -> EngineCoreClient:
    if config.parallel_config.data_parallel_size == 1:
        return InprocClient(config)
    return MPClient(config)


class InprocClient(EngineCoreClient):
    num_replicas = 1

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
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

    def scale(self, data_parallel_size: int) -> EngineCoreClient:
        check_new_size(self.config.parallel_config, data_parallel_size)
        if data_parallel_size == 1:
            return self
        if self.has_unfinished_requests():
            raise RuntimeError("scale() from the in-process engine needs it idle; finish or "
                               "abort the requests first")
        client = MPClient(resized(self.config, data_parallel_size))
        self.shutdown()
        return client

    def shutdown(self) -> None:
        self.core.shutdown()
