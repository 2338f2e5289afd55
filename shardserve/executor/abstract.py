"""The executor contract: how the engine reaches its workers, whatever runs them.

Every backend implements three things: `_init_executor` (start the workers), `collective_rpc`
(call one worker method on every rank) and `_shutdown` (stop them; `shutdown` runs it once).
Everything else on this class is a thin wrapper over `collective_rpc`, so a backend cannot drift
from the contract.
"""

from __future__ import annotations

import importlib
import logging
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from shardserve.config import BACKENDS, PP_BACKENDS, EngineConfig, KVCacheConfig
from shardserve.config.backends import backend_of_class
from shardserve.errors import EngineDeadError
from shardserve.lora.request import LoRARequest
from shardserve.messages import GrammarOutput, ModelRunnerOutput, SchedulerOutput

if TYPE_CHECKING:
    from shardserve.worker.profiler import ProfilerConfig

logger = logging.getLogger(__name__)

FailureCallback = Callable[[], None]


class Executor(ABC):
    uses_ray: bool = False
    supports_pp: bool = False
    """For a user's own backend class; the built-in ones say it in config/backends.py."""
    # execute_model of a step whose grammar bitmask comes later (`grammar_pending`) is sent at
    # once, so the forward pass overlaps the bitmask; needs calls that run in order on every
    # rank (collective_rpc). A backend that sends a step as one unit (a compiled graph) keeps
    # it until sample_tokens: correct, without the overlap.
    supports_early_forward: bool = True

    @staticmethod
    def get_class(config: EngineConfig) -> type[Executor]:
        """Map `parallel_config.distributed_executor_backend` to an Executor subclass."""
        backend = config.parallel_config.distributed_executor_backend
        if isinstance(backend, type):
            if not issubclass(backend, Executor):
                raise TypeError(f"distributed_executor_backend={backend!r} is not an Executor")
            return backend
        assert isinstance(backend, str)
        entry = BACKENDS.get(backend)
        if entry is None and "." not in backend:
            raise ValueError(
                f"distributed_executor_backend={backend!r} is not known; choose one of "
                f"{', '.join(BACKENDS)} or a dotted path 'pkg.module.ExecutorClass'"
            )
        module, name = (entry.module, entry.cls) if entry else backend.rsplit(".", 1)
        cls = getattr(importlib.import_module(module), name)
        if not (isinstance(cls, type) and issubclass(cls, Executor)):
            raise TypeError(f"{backend!r} is not an Executor subclass")
        return cls

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.parallel_config = config.parallel_config
        self.is_failed = False
        self._failure_callback: FailureCallback | None = None
        self._death: str | None = None  # why the executor failed, once it has
        self._death_exc: BaseException | None = None  # chained to the EngineDeadError
        self._shut_down = False
        self._shutdown_lock = threading.Lock()  # a concurrent shutdown waits for the first
        # Serialises failure marking: the callback must have run before any thread can see
        # `_death` and raise EngineDeadError (re-entrant: a callback may call back into us).
        self._fail_lock = threading.RLock()
        pp = self.parallel_config.pipeline_parallel_size
        if pp > 1 and not _supports_pp(type(self)):
            raise ValueError(
                f"{type(self).__name__} does not support pipeline_parallel_size={pp}; "
                f"use one of the backends {', '.join(PP_BACKENDS)}"
            )
        self._init_executor()

    # ---- what a backend implements ----
    @abstractmethod
    def _init_executor(self) -> None:
        """Start the workers and run init_device and load_model on each of them."""

    @abstractmethod
    def collective_rpc(
        self,
        method: str | Callable[..., Any],
        timeout: float | None = None,
        args: tuple = (),
        kwargs: dict[str, Any] | None = None,
        non_block: bool = False,
        unique_reply_rank: int | None = None,
    ) -> Any:
        """Call `method` on every rank's worker.

        Args:
            method: a Worker method name, or a callable run as `method(worker, *args, **kwargs)`.
            timeout: seconds to wait for every reply (None: wait for ever, unless the backend
                has a liveness check); on expiry a TimeoutError names the ranks that did not
                answer.
            non_block: return a Future instead of the result; futures complete in submission
                order and their `result(timeout)` honours the timeout.
            unique_reply_rank: return only this rank's result instead of a list.
        Returns:
            One result per rank, in rank order; or the one rank's result; or a Future of either.
        Raises:
            The first exception raised on any rank (with that rank's traceback), or
            EngineDeadError once the executor has failed.
        """

    @abstractmethod
    def _shutdown(self) -> None:
        """Stop every worker and free what the executor created; runs once (see shutdown).
        A backend whose `_init_executor` calls shutdown() when it fails part-way frees here
        whatever exists by then."""

    def shutdown(self) -> None:
        """Stop every worker and free what the executor created. Idempotent: a second caller
        returns at once, a concurrent one once the first is done. Calls made after it (and
        those still waiting, on backends that can tell) raise EngineDeadError."""
        with self._shutdown_lock:
            if self._shut_down:
                return
            self._shut_down = True  # first: failures from here on are the shutdown's own
            self._shutdown()

    # ---- thin wrappers over collective_rpc ----
    @property
    def output_rank(self) -> int:
        """The rank whose sampled tokens are returned: first TP rank of the last PP stage."""
        return self.parallel_config.layout.output_rank

    @property
    def max_concurrent_batches(self) -> int:
        """Steps the engine may keep in flight: one per pipeline stage; without stages, two
        with asynchronous scheduling (the next step is queued while the current one runs).

        Not two per stage: a stage cannot run a request's next token before the last stage
        has sampled it (see scheduler.py), so a second batch per stage would have no requests
        left to hold."""
        pp = self.parallel_config.pipeline_parallel_size
        if pp > 1:
            return pp
        return 2 if self.config.scheduler_config.async_scheduling else 1

    # One step is one call per rank: execute_model only stashes its SchedulerOutput, and
    # sample_tokens sends both as `Worker.execute_step` (one broadcast and one reply per step
    # instead of two of each). The two are still separate calls of the contract, so a grammar
    # bitmask computed after execute_model can go with sample_tokens.
    _stashed_step: SchedulerOutput | None = None

    def execute_model(
        self, scheduler_output: SchedulerOutput, non_block: bool = False
    ) -> ModelRunnerOutput | None | Future:
        self._raise_if_dead()
        if self._stashed_step is not None:
            raise RuntimeError("state error: sample_tokens() must follow each execute_model()")
        if scheduler_output.grammar_pending and self.supports_early_forward:
            # Nothing stashed: the sample_tokens that follows goes out on its own.
            return self.collective_rpc(
                "execute_model",
                args=(scheduler_output,),
                timeout=self.parallel_config.execute_timeout_s,
                non_block=non_block,
                unique_reply_rank=self.output_rank,
            )
        self._stashed_step = scheduler_output
        if not non_block:
            return None
        done: Future = Future()
        done.set_result(None)
        return done

    def sample_tokens(
        self, grammar_output: GrammarOutput | None, non_block: bool = False
    ) -> ModelRunnerOutput | Future:
        scheduler_output, self._stashed_step = self._stashed_step, None
        if scheduler_output is None:  # nothing stashed: a bare sample_tokens on every rank
            return self.collective_rpc(
                "sample_tokens",
                args=(grammar_output,),
                timeout=self.parallel_config.execute_timeout_s,
                non_block=non_block,
                unique_reply_rank=self.output_rank,
            )
        self._raise_if_dead()
        return self._execute_step(scheduler_output, grammar_output, non_block)

    def _execute_step(
        self,
        scheduler_output: SchedulerOutput,
        grammar_output: GrammarOutput | None,
        non_block: bool,
    ) -> ModelRunnerOutput | Future:
        """Run one whole step on every rank; the output rank's result (or its Future)."""
        return self.collective_rpc(
            "execute_step",
            args=(scheduler_output, grammar_output),
            timeout=self.parallel_config.execute_timeout_s,
            non_block=non_block,
            unique_reply_rank=self.output_rank,
        )

    def determine_available_memory(self) -> list[int]:
        return self.collective_rpc("determine_available_memory")

    def get_kv_cache_block_bytes(self) -> list[int]:
        return self.collective_rpc("get_kv_cache_block_bytes")

    def initialize_from_config(self, kv_cache_config: KVCacheConfig) -> None:
        self.collective_rpc("initialize_from_config", args=(kv_cache_config,))
        self.collective_rpc("compile_or_warm_up_model")

    def mark_failed(self, reason: str) -> None:
        """The engine gives up on this executor (a step failed): every call still waiting, and
        every later one, raises EngineDeadError. No-op if it failed or shut down already."""
        self._mark_failed(reason)

    def _mark_failed(self, reason: str, cause: BaseException | None = None) -> None:
        """Record the first failure (not after shutdown), log it, run the callback once.
        `cause` (e.g. a worker's remote traceback) is chained to every EngineDeadError then.

        Ordering: `is_failed` first (so a concurrent `register_failure_callback` runs its
        callback itself), then the callback, and only then `_death`, which is what every call
        path raises from: whoever sees EngineDeadError can rely on the callback having run.
        """
        with self._fail_lock:
            if self._shut_down or self.is_failed:
                return
            self.is_failed = True
            logger.error("%s; the engine cannot continue", reason)
            callback, self._failure_callback = self._failure_callback, None
            try:
                if callback is not None:
                    callback()
            finally:
                self._death_exc = cause
                self._death = reason

    def _raise_if_dead(self) -> None:
        if self._death is not None:
            raise EngineDeadError(self._death) from self._death_exc
        if self._shut_down:
            raise EngineDeadError("the executor has been shut down")

    @property
    def failure(self) -> str | None:
        """Why the executor failed (the rank, its pid and how it died), once it has."""
        return self._death

    def register_failure_callback(self, callback: FailureCallback) -> None:
        """Run `callback` once when the executor fails (at once if it already has)."""
        with self._fail_lock:
            if not self.is_failed:
                self._failure_callback = callback
                return
        callback()

    def check_health(self) -> None:
        if self.is_failed:
            raise EngineDeadError("the executor has failed; see the earlier error")
        self.collective_rpc("check_health", timeout=10.0)

    def sleep(self, level: int = 1) -> None:
        self.collective_rpc("sleep", kwargs={"level": level})

    # LoRA adapters: every rank loads its own share (TP shards, PP stages), and every rank
    # sees the same calls in the same order, so their answers (and LRU evictions) agree; a
    # disagreement means a rank's state went astray and is an error, not a majority vote.
    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load the adapter on every rank; False where it was loaded already. A refused
        adapter raises its LoRAError; ranks that had loaded it drop it again."""
        try:
            return self._same_on_every_rank("add_lora", lora_request)
        except BaseException:
            if not self.is_failed:
                self.collective_rpc("remove_lora", args=(lora_request.lora_int_id,))
            raise

    def remove_lora(self, lora_int_id: int) -> bool:
        return self._same_on_every_rank("remove_lora", lora_int_id)

    def pin_lora(self, lora_int_id: int) -> bool:
        return self._same_on_every_rank("pin_lora", lora_int_id)

    def list_loras(self) -> list[int]:
        """The adapter ids loaded, sorted (the same on every rank)."""
        return self._same_on_every_rank("list_loras")

    def _every_rank(self, method: str, args: tuple) -> list[Any]:
        """Each rank's answer, in rank order (a backend whose collective_rpc reaches only its
        own rank gathers the others' itself)."""
        return self.collective_rpc(method, args=args)

    def _same_on_every_rank(self, method: str, *args: Any) -> Any:
        """Call `method` on every rank; its one answer, or RuntimeError naming the ranks that
        answered otherwise than rank 0."""
        results = self._every_rank(method, args)
        odd = [rank for rank, r in enumerate(results) if r != results[0]]
        if odd:
            raise RuntimeError(f"{method}{args}: ranks {odd} answered {[results[r] for r in odd]}"
                               f" but rank 0 answered {results[0]!r}; the ranks' adapters "
                               f"disagree")
        return results[0]

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.collective_rpc("wake_up", kwargs={"tags": tags})

    def start_profile(self, config: ProfilerConfig) -> None:
        """torch's profiler on every rank (worker/profiler.py)."""
        self.collective_rpc("start_profile", args=(config,))

    def stop_profile(self) -> list[str]:
        """Stop every rank's profile; the trace file each wrote, in rank order."""
        return self.collective_rpc("stop_profile")


def _supports_pp(cls: type[Executor]) -> bool:
    """The backend table's word for a built-in class (or one derived from it), else the
    class's own `supports_pp`."""
    for klass in cls.__mro__:
        entry = backend_of_class(klass.__module__, klass.__qualname__)
        if entry is not None:
            return entry.supports_pp
    return cls.supports_pp
