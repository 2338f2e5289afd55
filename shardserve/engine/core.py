"""EngineCore: the scheduler and the executor, stepped together. Token ids in, token ids out."""

from __future__ import annotations

import logging

from shardserve.config import EngineConfig, KVCacheConfig
from shardserve.engine.kv_cache import KVCacheManager
from shardserve.engine.request import Request
from shardserve.engine.scheduler import Scheduler
from shardserve.errors import EngineDeadError
from shardserve.executor.abstract import Executor
from shardserve.messages import EngineCoreOutput

logger = logging.getLogger(__name__)


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
        )
        self.dead = False

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
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[EngineCoreOutput]:
        """Schedule one batch, run it on every worker, and fold the sampled tokens back in."""
        if self.dead:
            raise EngineDeadError("the engine failed earlier and cannot run more steps")
        if not self.scheduler.has_unfinished_requests():
            return []
        scheduler_output = self.scheduler.schedule()
        try:
            self.executor.execute_model(scheduler_output)
            model_output = self.executor.sample_tokens(None)
        except BaseException:
            # The workers' request state may now disagree with the scheduler's: stop for good.
            self.dead = True
            raise
        return self.scheduler.update_from_output(scheduler_output, model_output)

    def sleep(self, level: int = 1) -> None:
        if self.has_unfinished_requests():
            raise RuntimeError("sleep() needs an idle engine; finish or abort the requests first")
        self._flush_finished()
        self.executor.sleep(level)

    def _flush_finished(self) -> None:
        """Tell the workers about requests that finished after the last step."""
        sched = self.scheduler.schedule()
        if sched.finished_req_ids:
            self.executor.execute_model(sched)
            self.executor.sample_tokens(None)

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.executor.wake_up(tags)

    def shutdown(self) -> None:
        self.executor.shutdown()
