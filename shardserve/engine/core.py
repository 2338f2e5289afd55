"""EngineCore: the scheduler and the executor, stepped together. Token ids in, token ids out.

The batch queue: up to `executor.max_concurrent_batches` steps in flight (2 with asynchronous
scheduling, 1 without; one per stage with pipeline parallelism), completed in submission order.

    step():  schedule N+1 ──submit──▶ executor (execute_model + sample_tokens, non-blocking)
             queue full or nothing to add? ──▶ wait for the oldest step N ──▶ fold its tokens in

With two in flight the workers start step N+1 the moment step N ends, while this process folds
N's tokens in and plans N+2. The scheduler counts scheduled tokens as computed at once (see
scheduler.py), so it never schedules a token that is already in flight.

Structured outputs: step N+1's grammar bitmask needs the tokens step N is still sampling. Such a
step is submitted with `grammar_pending`: execute_model goes out at once (a backend with
`supports_early_forward` starts the forward pass), its sample_tokens waits in the queue
(`_InFlight.sampled` is None) until N's tokens are folded in and the bitmask can be built; no
other step is submitted meanwhile. The bitmask work thus overlaps N+1's forward pass.
"""

from __future__ import annotations

import logging
from collections import deque
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass

from shardserve.config import EngineConfig, KVCacheConfig
from shardserve.engine.kv_cache import KVCacheManager
from shardserve.engine.request import Request
from shardserve.engine.scheduler import Scheduler
from shardserve.engine.structured_output import StructuredOutputManager
from shardserve.errors import EngineDeadError
from shardserve.executor.abstract import Executor
from shardserve.lora.request import LoRARequest
from shardserve.messages import (
    EngineCoreOutput,
    GrammarOutput,
    ModelRunnerOutput,
    SchedulerOutput,
)
from shardserve.worker.profiler import (
    ENGINE_STEP_LABEL,
    ProfilerConfig,
    TraceProfiler,
    active_in_process,
    engine_trace_name,
)

logger = logging.getLogger(__name__)

# How long a failed engine waits for each remaining in-flight step to resolve (they fail fast
# once the executor has failed; this only bounds a backend that does not).
_DRAIN_TIMEOUT_S = 5.0
# Longest step() waits for a compiling grammar when nothing else can run.
_GRAMMAR_POLL_S = 0.01


@dataclass
class _InFlight:
    """One submitted step: its plan and the futures of its two calls."""

    scheduler_output: SchedulerOutput
    # execute_model's Future: already done where the executor sends the step as one call with
    # sample_tokens (every built-in backend); a backend that runs it on its own may fail here.
    executed: Future
    # sample_tokens: the output rank's ModelRunnerOutput; None while its bitmask waits.
    sampled: Future | None

    def result(self) -> ModelRunnerOutput:
        self.executed.result()
        assert self.sampled is not None, "released before it is waited for (see step())"
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
            KVCacheManager(kv_config.num_blocks, config.virtual_block_size,
                           config.cache_config.enable_prefix_caching),
            config.model_config.max_model_len,
            num_stages=config.parallel_config.pipeline_parallel_size,
            speculative_config=config.speculative_config,
            lora_config=config.lora_config,
        )
        self.dead = False
        self.sleep_level = 0  # 0 awake; else the level of the last sleep()
        self._profiling = False
        self._profiler: TraceProfiler | None = None  # this process's own, when it has one
        self.max_concurrent_batches = self.executor.max_concurrent_batches
        self.batch_queue: deque[_InFlight] = deque()
        model = config.model_config
        self.structured = StructuredOutputManager(model.tokenizer_path, model.arch.vocab_size,
                                                  model.arch.eos_token_ids,
                                                  model.trust_remote_code)

    def _initialize_kv_cache(self) -> KVCacheConfig:
        """As many blocks as the tightest rank holds; the scheduler counts each block as
        virtual_block_size tokens (with DCP every rank of the group stores its share of a
        block's positions in its own physical block of that id)."""
        cache, tokens_per_block = self.config.cache_config, self.config.virtual_block_size
        block_bytes = max(self.executor.get_kv_cache_block_bytes())
        available = min(self.executor.determine_available_memory())
        num_blocks = cache.num_blocks_override or available // block_bytes
        capacity, max_len = num_blocks * tokens_per_block, self.config.model_config.max_model_len
        dcp = self.config.parallel_config.decode_context_parallel_size
        if capacity < max_len:
            raise ValueError(
                f"the KV cache holds {capacity} tokens ({num_blocks} blocks of "
                f"{tokens_per_block} tokens, {block_bytes} bytes each per rank, from "
                f"{available} bytes available) but max_model_len={max_len}: lower max_model_len "
                f"or raise kv_cache_memory_bytes / kv_cache_memory_fraction"
                + (f" or decode_context_parallel_size (now {dcp})" if dcp > 1 else ""))
        kv_config = KVCacheConfig(num_blocks=num_blocks, block_size=cache.block_size)
        logger.info("KV cache: %d blocks x %d tokens (%.1f MiB per rank); capacity %d tokens "
                    "(%d per rank%s)", num_blocks, tokens_per_block,
                    num_blocks * block_bytes / 2**20, capacity, capacity // dcp,
                    f", KV sharded over {dcp} ranks" if dcp > 1 else "")
        self.executor.initialize_from_config(kv_config)
        return kv_config

    @property
    def kv_cache_capacity_tokens(self) -> int:
        """Tokens the engine's KV cache holds: num_blocks x block_size x DCP."""
        return self.scheduler.kv.num_blocks * self.scheduler.kv.block_size

    def add_request(self, request: Request) -> None:
        spec = request.sampling_params.structured_outputs
        if spec is not None:
            request.grammar = self.structured.grammar_for(spec)
            # A moved request (input_processor.py): the matcher takes its tokens once ready.
            request.grammar.replay = list(request.output_token_ids)
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.abort_requests(request_ids)

    # ---- LoRA adapters, on every rank (the front end's utility calls) ----
    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load the adapter on every rank (False: it was loaded already); a bad adapter raises
        its LoRAError (a ValueError) and leaves the engine as it was."""
        return self.executor.add_lora(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        self.scheduler.loras.pinned.discard(lora_int_id)
        return self.executor.remove_lora(lora_int_id)

    def pin_lora(self, lora_int_id: int) -> bool:
        """Keep the adapter loaded on every rank (False: it is not loaded); refused when the
        running requests' adapters would no longer fit beside the pinned ones."""
        self.scheduler.loras.check_pin(lora_int_id, self.scheduler.running)
        pinned = self.executor.pin_lora(lora_int_id)
        if pinned:
            self.scheduler.loras.pinned.add(lora_int_id)
        return pinned

    def list_loras(self) -> list[int]:
        return self.executor.list_loras()

    def has_unfinished_requests(self) -> bool:
        # Steps still in flight count: their results must be collected (and maybe discarded).
        return self.scheduler.has_unfinished_requests() or bool(self.batch_queue)

    def step(self) -> list[EngineCoreOutput]:
        """Submit the next batch if there is room; then, if the queue is full or nothing more
        could be added, wait for the oldest batch and return its outputs (else [])."""
        if self.dead:
            raise EngineDeadError("the engine failed earlier and cannot run more steps")
        ended = self.scheduler.take_ended_outside()
        if self._has_room() and self._submit_next():
            if self._has_room():
                return ended  # room for one more: plan it before waiting
        if not self.batch_queue:
            self._wait_for_grammars()
            return ended
        flight = self.batch_queue.popleft()
        try:
            model_output = flight.result()
        except BaseException as e:
            # The workers' request state may now disagree with the scheduler's: stop for good.
            self._fail_in_flight(e)
            raise
        outputs = self.scheduler.update_from_output(flight.scheduler_output, model_output)
        self._release_deferred()
        return ended + outputs

    def _has_room(self) -> bool:
        """Another step may be submitted: the queue has room and no step waits for its
        bitmask (its sample_tokens must go out before the next execute_model)."""
        return len(self.batch_queue) < self.max_concurrent_batches and not (
            self.batch_queue and self.batch_queue[-1].sampled is None)

    def _wait_for_grammars(self) -> None:
        """Nothing to run but requests whose grammar compiles: wait a moment for one instead
        of spinning."""
        compiling = self.scheduler.compiling_grammars()
        if compiling:
            wait(compiling, timeout=_GRAMMAR_POLL_S, return_when=FIRST_COMPLETED)

    def _submit_next(self) -> bool:
        """Schedule a batch and submit both of its calls without waiting; False if empty."""
        if not self.scheduler.has_unfinished_requests():
            return False
        so = self.scheduler.schedule()
        if so.total_num_scheduled_tokens == 0 and not (
            so.finished_req_ids or so.preempted_req_ids
        ):
            return False  # everything runnable is in flight already
        grammar = self._bitmask(so) if so.structured_positions else None
        so.grammar_pending = bool(so.structured_positions) and grammar is None
        try:
            executed = self.executor.execute_model(so, non_block=True)
            sampled = None if so.grammar_pending else self.executor.sample_tokens(
                grammar, non_block=True)
        except BaseException as e:
            self._fail_in_flight(e)
            raise
        self.batch_queue.append(_InFlight(so, executed, sampled))
        return True

    def _bitmask(self, so: SchedulerOutput) -> GrammarOutput | None:
        requests = self.scheduler.requests
        grammars = {rid: getattr(requests.get(rid), "grammar", None)
                    for rid in so.structured_positions}
        return self.structured.bitmask(so, grammars)

    def _release_deferred(self) -> None:
        """Send sample_tokens of the step waiting for its bitmask, once it can be built (every
        earlier token of its constrained requests folded in)."""
        if not self.batch_queue or self.batch_queue[-1].sampled is not None:
            return
        flight = self.batch_queue[-1]
        grammar = self._bitmask(flight.scheduler_output)
        if grammar is None and len(self.batch_queue) > 1:
            return  # an earlier step still holds one of its tokens
        if grammar is None:  # cannot happen: every earlier step is folded in
            raise RuntimeError("state error: a step's bitmask waits for no step in flight")
        try:
            flight.sampled = self.executor.sample_tokens(grammar, non_block=True)
        except BaseException as e:
            self._fail_in_flight(e)
            raise

    def _fail_in_flight(self, error: BaseException) -> None:
        """Mark the engine and its executor dead and resolve every step still in flight: with
        the executor failed, each of their futures raises EngineDeadError at once (the ranks
        may be stuck in a collective that a failed rank never joined), so none is left waiting."""
        self.dead = True
        self.executor.mark_failed(f"a model step failed ({type(error).__name__}: {error})")
        while self.batch_queue:
            flight = self.batch_queue.popleft()
            for future in (flight.executed, flight.sampled):
                if future is None:  # its sample_tokens never went out
                    continue
                try:
                    future.result(timeout=_DRAIN_TIMEOUT_S)
                except BaseException:  # expected: the step failed with the engine
                    pass

    def sleep(self, level: int = 1) -> None:
        if self.config.model_config.enable_sleep_mode is False:
            raise RuntimeError("sleep() is off: this engine was built with "
                               "enable_sleep_mode=False; pass enable_sleep_mode=True (or leave "
                               "it unset) to free its memory while idle")
        if self.scheduler.has_unfinished_requests():
            raise RuntimeError("sleep() needs an idle engine; finish or abort the requests first")
        # Steps still in flight can only hold requests that have finished (a front end that
        # saw their last token, or aborted them, may call right away): collect them first.
        while self.batch_queue:
            self.step()
        self._flush_finished()
        self.executor.sleep(level)
        self.sleep_level = level

    def _flush_finished(self) -> None:
        """Tell the workers about requests that finished after the last step (sleep() runs
        only with no step in flight)."""
        sched = self.scheduler.schedule()
        if sched.finished_req_ids:
            self.executor.execute_model(sched)
            self.executor.sample_tokens(None)

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.executor.wake_up(tags)
        # Awake once both are back (level 1 freed only the KV cache).
        if tags is None or "kv_cache" in tags and ("weights" in tags or self.sleep_level == 1):
            self.sleep_level = 0

    def is_sleeping(self) -> bool:
        return self.sleep_level > 0

    def start_profile(self, config: ProfilerConfig) -> None:
        """torch's profiler on every rank and in this core (worker/profiler.py); refused while
        a profile runs."""
        if self._profiling:
            raise RuntimeError("a profile is already running; call stop_profile() first")
        self.executor.start_profile(config)
        self._profiling = True
        if not active_in_process():  # else a rank runs here (uni): its trace has our work too
            dp = self.config.parallel_config.data_parallel_rank
            self._profiler = TraceProfiler(f"engine core {dp}", engine_trace_name(dp), self,
                                           "step", ENGINE_STEP_LABEL)
            self._profiler.start(config)

    def stop_profile(self) -> list[str]:
        """Stop the profile; the trace files written (every rank's, then this core's)."""
        if not self._profiling:
            raise RuntimeError("no profile is running; call start_profile() first")
        self._profiling = False
        profiler, self._profiler = self._profiler, None
        paths = list(self.executor.stop_profile())
        return paths + ([profiler.stop()] if profiler is not None else [])

    def shutdown(self) -> None:
        self.structured.shutdown()
        self.executor.shutdown()
