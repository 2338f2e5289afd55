"""What the asyncio front end (async_engine.py) hands out and reports: each request's newest
output (`OutputCollector`), the queue-full refusal, and the metrics sink nobody keeps
(`NoMetrics`; the server's ServerMetrics has the same methods)."""

from __future__ import annotations

import asyncio

from shardserve.engine.core_wire import SchedulerStats
from shardserve.messages import EngineCoreOutput
from shardserve.outputs import RequestOutput

_RETRY_AFTER_S = 1


class QueueFullError(Exception):
    """Too many requests waiting for the engine: answered 503 with Retry-After."""

    retry_after_s = _RETRY_AFTER_S


class NoMetrics:
    """What AsyncEngineClient reports, and where nobody keeps it (the server's ServerMetrics
    has the same methods)."""

    def set_replicas(self, serving: int, indices: list[int]) -> None: ...

    def remove_replica(self, index: int) -> None: ...

    def on_stats(self, engine: int, stats: SchedulerStats) -> None: ...

    def on_request_added(self, engine_ids: list[str], num_prompt_tokens: int) -> None: ...

    def on_outputs(self, outputs: list[EngineCoreOutput], now: float) -> None: ...

    def on_finished(self, engine_ids: list[str], reason: str) -> None: ...

    def on_rejected(self, reason: str) -> None: ...

    def on_engine_restart(self, engine: int) -> None: ...

    def on_requests_migrated(self, count: int) -> None: ...

    def on_requests_failed_after_migration(self, count: int) -> None: ...


class OutputCollector:
    """The newest cumulative output of one request not yet taken, or the error that ended it
    (an error replaces an untaken output and is never replaced)."""

    def __init__(self) -> None:
        self._item: RequestOutput | BaseException | None = None
        self._ready = asyncio.Event()

    def put(self, item: RequestOutput | BaseException) -> None:
        if not isinstance(self._item, BaseException):
            self._item = item
            self._ready.set()

    async def get(self) -> RequestOutput:
        await self._ready.wait()
        item = self._item
        if isinstance(item, BaseException):
            raise item
        self._ready.clear()
        self._item = None
        assert item is not None
        return item
