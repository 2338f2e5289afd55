"""EngineCore: the scheduler and the executor, stepped together. Token ids in, token ids out.

The batch queue: up to `executor.max_concurrent_batches` steps in flight (2 with asynchronous
scheduling, 1 without; one per stage with pipeline parallelism), completed in submission order.

    step():  schedule N+1 ──submit──▶ executor (execute_model + sample_tokens, non-blocking)
             queue full or nothing to add? ──▶ wait for the oldest step N ──▶ fold its tokens in

With two in flight the workers start step N+1 the moment step N ends, while this process folds
N's tokens in and plans N+2. The scheduler counts scheduled tokens as computed at once (see
scheduler.py), so it never schedules a token that is already in flight.
"""

from __future__ import annotations

import logging
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass

from shardserve.config import EngineConfig, KVCacheConfig
from shardserve.engine.kv_cache import KVCacheManager
from shardserve.engine.request import Request
from shardserve.engine.scheduler import Scheduler
from shardserve.errors import EngineDeadError
from shardserve.executor.abstract import Executor
from shardserve.messages import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)

# How long a failed engine waits for each remaining in-flight step to resolve (they fail fast
# once the executor has failed; this only bounds a backend that does not).
_DRAIN_TIMEOUT_S = 5.0


@dataclass
class _InFlight:
    """One submitted step: its plan and the futures of its two calls."""

    scheduler_output: SchedulerOutput
    # execute_model's Future: already done where the executor sends the step as one call with
    # sample_tokens (every built-in backend); a backend that runs it on its own may fail here.
    executed: Future
    sampled: Future  # sample_tokens: the output rank's ModelRunnerOutput

    def result(self) -> ModelRunnerOutput:
        self.executed.result()
        return self.sampled.result()


class EngineCore:
    def __init__(self, config: EngineConfig, executor_class: type[Executor] | None = None) -> None:
        self.config = config
        self.executor = (executor_class or Executor.get_class(config))(config)
        try:
            kv_config = self._initialize_kv_cache()
        except BaseException:
            self.executor.shutdown()
            raise
        self.kv_cache_config = kv_config
        self.scheduler = Scheduler(
            config.scheduler_config,
            KVCacheManager(kv_config.num_blocks, kv_config.block_size),
            config.model_config.max_model_len,
            num_stages=config.parallel_config.pipeline_parallel_size,
        )
        self.dead = False
        self.max_concurrent_batches = self.executor.max_concurrent_batches
        self.batch_queue: deque[_InFlight] = deque()

    def _initialize_kv_cache(self) -> KVCacheConfig:
        cache = self.config.cache_config
        block_bytes = max(self.executor.get_kv_cache_block_bytes())
        available = min(self.executor.determine_available_memory())
        num_blocks = cache.num_blocks_override or available // block_bytes
        max_len = self.config.model_config.max_model_len
        if num_blocks * cache.block_size < max_len:
            raise ValueError(
                f"the KV cache holds {num_blocks * cache.block_size} tokens "
                f"({num_blocks} blocks of "
                f"{cache.block_size}, {block_bytes} bytes each, from {available} bytes available) "
                f"but max_model_len={max_len}: lower max_model_len or raise "
                f"kv_cache_memory_bytes / kv_cache_memory_fraction"
            )
        kv_config = KVCacheConfig(num_blocks=num_blocks, block_size=cache.block_size)
        logger.info(
            "KV cache: %d blocks x %d tokens (%.1f MiB per rank)",
            num_blocks,
            cache.block_size,
            num_blocks * block_bytes / 2**20,
        )
        self.executor.initialize_from_config(kv_config)
        return kv_config

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.abort_requests(request_ids)

    def has_unfinished_requests(self) -> bool:
        # Steps still in flight count: their results must be collected (and maybe discarded).
        return self.scheduler.has_unfinished_requests() or bool(self.batch_queue)

    def step(self) -> list[EngineCoreOutput]:
        """Submit the next batch if there is room; then, if the queue is full or nothing more
        could be added, wait for the oldest batch and return its outputs (else [])."""
        if self.dead:
            raise EngineDeadError("the engine failed earlier and cannot run more steps")
        if len(self.batch_queue) < self.max_concurrent_batches and self._submit_next():
            if len(self.batch_queue) < self.max_concurrent_batches:
                return []  # room for one more: plan it before waiting
        if not self.batch_queue:
            return []
        flight = self.batch_queue.popleft()
        try:
            model_output = flight.result()
        except BaseException as e:
            # The workers' request state may now disagree with the scheduler's: stop for good.
            self._fail_in_flight(e)
            raise
        return self.scheduler.update_from_output(flight.scheduler_output, model_output)

    def _submit_next(self) -> bool:
        """Schedule a batch and submit both of its calls without waiting; False if empty."""
        if not self.scheduler.has_unfinished_requests():
            return False
        so = self.scheduler.schedule()
        if so.total_num_scheduled_tokens == 0 and not (
            so.finished_req_ids or so.preempted_req_ids
        ):
            return False  # everything runnable is in flight already
        try:
            executed = self.executor.execute_model(so, non_block=True)
            sampled = self.executor.sample_tokens(None, non_block=True)
        except BaseException as e:
            self._fail_in_flight(e)
            raise
        self.batch_queue.append(_InFlight(so, executed, sampled))
        return True

    def _fail_in_flight(self, error: BaseException) -> None:
        """Mark the engine and its executor dead and resolve every step still in flight: with
        the executor failed, each of their futures raises EngineDeadError at once (the ranks
        may be stuck in a collective that a failed rank never joined), so none is left waiting."""
        self.dead = True
        self.executor.mark_failed(f"a model step failed ({type(error).__name__}: {error})")
        while self.batch_queue:
            flight = self.batch_queue.popleft()
            for future in (flight.executed, flight.sampled):
                try:
                    future.result(timeout=_DRAIN_TIMEOUT_S)
                except BaseException:  # expected: the step failed with the engine
                    pass

    def sleep(self, level: int = 1) -> None:
        if self.has_unfinished_requests():
            raise RuntimeError("sleep() needs an idle engine; finish or abort the requests first")
        self._flush_finished()
        self.executor.sleep(level)

    def _flush_finished(self) -> None:
        """Tell the workers about requests that finished after the last step (sleep() runs
        only with no step in flight)."""
        sched = self.scheduler.schedule()
        if sched.finished_req_ids:
            self.executor.execute_model(sched)
            self.executor.sample_tokens(None)

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.executor.wake_up(tags)

    def shutdown(self) -> None:
        self.executor.shutdown()
