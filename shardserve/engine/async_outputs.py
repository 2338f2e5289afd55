"""What the asyncio front end (async_engine.py) hands out and reports: each request's newest
output (`OutputCollector`), the queue-full refusal, the metrics sink nobody keeps (`NoMetrics`;
the server's ServerMetrics has the same methods) and the periodic stats line (`StatsLog`)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from shardserve import envs
from shardserve.engine.core_wire import SchedulerStats
from shardserve.engine.spec_decode_scheduling import spec_decode_line
from shardserve.messages import EngineCoreOutput
from shardserve.outputs import RequestOutput

logger = logging.getLogger("shardserve.engine.async_engine")  # where the line always came from

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


class StatsLog:
    """The periodic stats line: every 10 s (SHARDSERVE_LOG_STATS_INTERVAL_S) while there is
    work, throughput, queue and KV use, as vLLM logs them (--disable-log-stats turns it off),
    and the speculative-decoding line. The front end adds to `tokens` (prompt, generated)."""

    def __init__(self) -> None:
        self.tokens = [0, 0]
        self._spec_logged = SchedulerStats()  # the totals of the last stats line

    async def run(self, stats_now: Callable[[], SchedulerStats]) -> None:
        last, interval = time.monotonic(), envs.log_stats_interval_s()
        while True:
            await asyncio.sleep(interval)
            now = time.monotonic()
            (prompt, generated), self.tokens = self.tokens, [0, 0]
            stats, elapsed, last = stats_now(), now - last, now
            if prompt or generated or stats.num_running or stats.num_waiting:
                logger.info(
                    "Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f "
                    "tokens/s, Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%",
                    prompt / elapsed, generated / elapsed, stats.num_running,
                    stats.num_waiting, 100 * stats.kv_cache_usage)
            line, self._spec_logged = spec_decode_line(stats, self._spec_logged)
            if line:
                logger.info("%s", line)
