"""Worker: the object every executor backend drives, by method name, on every rank.

Its public methods are the executor's vocabulary (`collective_rpc("load_model")` and so on); the
same class runs in-process (uni), in a worker process (mp, ray_v2) or inside a Ray actor (ray).
"""

from __future__ import annotations

import functools
import gc
import logging
import os
from collections.abc import Callable
from typing import Any

import psutil
import torch

from shardserve import envs
from shardserve.config import EngineConfig, KVCacheConfig
from shardserve.distributed.parallel_state import destroy_distributed, init_distributed
from shardserve.lora.request import LoRARequest
from shardserve.messages import GrammarOutput, ModelRunnerOutput, SchedulerOutput
from shardserve.worker.lora_worker import WorkerLoRAs
from shardserve.worker.model_runner import ModelRunner
from shardserve.worker.profiler import (
    RANK_STEP_LABEL,
    ProfilerConfig,
    TraceProfiler,
    rank_trace_name,
)

logger = logging.getLogger(__name__)


def run_method(obj: Any, method: str | Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """Call a method by name, or a callable with `obj` as its first argument."""
    if isinstance(method, str):
        fn = getattr(obj, method, None)
        if fn is None or method.startswith("_"):
            raise AttributeError(f"{type(obj).__name__} has no public method {method!r}")
    else:
        fn = functools.partial(method, obj)
    return fn(*args, **kwargs)


class Worker:
    def __init__(
        self,
        config: EngineConfig,
        rank: int = 0,
        local_rank: int = 0,
        distributed_init_method: str | None = None,
        local_world_size: int | None = None,
    ) -> None:
        self.config = config
        self.rank = rank
        self.local_rank = local_rank
        self.world_size = config.parallel_config.world_size
        self.local_world_size = local_world_size or self.world_size
        self.distributed_init_method = distributed_init_method
        self.device = torch.device("cpu")
        self.model_runner: ModelRunner | None = None
        self.data_parallel_size = config.parallel_config.data_parallel_size
        self._default_threads = torch.get_num_threads()
        self._profiler: TraceProfiler | None = None

    def set_data_parallel_size(self, size: int) -> int:
        """The engine was re-scaled to `size` replicas: take this rank's new share of the
        machine's cores (unless SHARDSERVE_NUM_THREADS fixes it). Returns the thread count."""
        self.data_parallel_size = size
        self._set_threads()
        return torch.get_num_threads()

    def _set_threads(self) -> None:
        threads = envs.num_threads()
        if threads == 0 and self.device.type == "cpu":
            # Ranks sharing a machine split its cores; oversubscription makes every step slower.
            # Alone, torch's own default (physical cores) stands.
            threads = max(1, len(os.sched_getaffinity(0)) // self.ranks_on_machine) \
                if self.ranks_on_machine > 1 else self._default_threads
        if threads > 0:
            torch.set_num_threads(threads)

    @property
    def ranks_on_machine(self) -> int:
        """This machine's ranks over every data-parallel replica."""
        pc = self.config.parallel_config
        if pc.multinode.nnodes > 1:
            return pc.layout.ranks_per_node
        return self.local_world_size * self.data_parallel_size  # replicas are local

    def init_device(self) -> None:
        if self.config.device_config.device == "cuda":
            self.device = torch.device("cuda", self.local_rank)
            torch.cuda.set_device(self.device)
        self._set_threads()
        if self.world_size > 1:
            if self.distributed_init_method is None:
                raise ValueError("a multi-rank worker needs distributed_init_method")
            backend = "nccl" if self.device.type == "cuda" else "gloo"
            pc = self.config.parallel_config
            init_distributed(
                self.rank, self.world_size, self.distributed_init_method, backend,
                layout=pc.layout.replica(), pp_slot_bytes=self._handoff_bytes(),
                pp_timeout_s=pc.execute_timeout_s,
                nodes=pc.layout.nodes_of_replica(pc.data_parallel_rank),
            )
        torch.manual_seed(self.config.model_config.seed)

    def _handoff_bytes(self) -> int:
        """The largest stage-to-stage message: a full step's (hidden, residual) pair."""
        tokens = self.config.scheduler_config.max_num_batched_tokens
        itemsize = torch.empty((), dtype=self.config.model_config.torch_dtype).element_size()
        return 2 * tokens * self.config.model_config.arch.hidden_size * itemsize

    def load_model(self) -> None:
        self.model_runner = ModelRunner(self.config, self.device)
        self.model_runner.load_model()

    def determine_available_memory(self) -> int:
        """Bytes this worker can give to its KV cache."""
        cache = self.config.cache_config
        if cache.kv_cache_memory_bytes is not None:
            return cache.kv_cache_memory_bytes
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            if cache.gpu_memory_utilization is not None:  # vLLM's: a share of the whole GPU
                used = total - free
                return max(0, int(total * cache.gpu_memory_utilization) - used)
            return int(free * cache.kv_cache_memory_fraction)
        # Ranks on one machine share its memory.
        free = psutil.virtual_memory().available
        return int(free * cache.kv_cache_memory_fraction / self.ranks_on_machine)

    def get_kv_cache_block_bytes(self) -> int:
        return self._runner().kv_cache_block_bytes()

    def initialize_from_config(self, kv_cache_config: KVCacheConfig) -> None:
        self._runner().initialize_kv_cache(kv_cache_config)

    def compile_or_warm_up_model(self) -> None:
        self._runner().warm_up()

    def execute_model(self, scheduler_output: SchedulerOutput) -> None:
        self._runner().execute_model(scheduler_output)

    def sample_tokens(self, grammar_output: GrammarOutput | None) -> ModelRunnerOutput:
        return self._runner().sample_tokens(grammar_output)

    def execute_step(
        self, scheduler_output: SchedulerOutput, grammar_output: GrammarOutput | None
    ) -> ModelRunnerOutput:
        """execute_model then sample_tokens: what the executor sends as one call per step."""
        self.execute_model(scheduler_output)
        return self.sample_tokens(grammar_output)

    def get_idle_gaps(self, reset: bool = True) -> list[float]:
        """Seconds the model sat idle between consecutive steps (end of one step's sampling to
        the start of the next execute_model), since the last reset."""
        runner = self._runner()
        gaps = list(runner.idle_gaps)
        if reset:
            runner.reset_idle_gaps()
        return gaps

    def check_health(self) -> None:
        """Raises if this worker cannot serve (the call reaching us proves the process is alive)."""
        runner = self._runner()
        if runner.model is None:
            raise RuntimeError(f"worker rank {self.rank} has no model loaded")

    def get_rank(self) -> int:
        return self.rank

    def sleep(self, level: int = 1) -> None:
        """Level 1 frees the KV cache; level 2 also frees the weights (reloaded on wake_up)."""
        if level not in (1, 2):
            raise ValueError(f"sleep level={level!r} must be 1 or 2")
        runner = self._runner()
        if runner.requests:
            raise RuntimeError(f"cannot sleep with {len(runner.requests)} requests in flight")
        runner.free_kv_cache()
        if level == 2:
            runner.free_model()
        gc.collect()

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Restore what sleep freed: tags 'weights' and/or 'kv_cache' (default: both)."""
        tags = tags or ["weights", "kv_cache"]
        unknown = set(tags) - {"weights", "kv_cache"}
        if unknown:
            raise ValueError(f"wake_up tags {sorted(unknown)} unknown; use 'weights', 'kv_cache'")
        runner = self._runner()
        if "weights" in tags and runner.model is None:
            runner.load_model()
        if "kv_cache" in tags and runner.kv_caches is None and runner.kv_cache_config is not None:
            runner.initialize_kv_cache(runner.kv_cache_config)

    def start_profile(self, config: ProfilerConfig) -> None:
        """Start torch's profiler on this rank (see worker/profiler.py); refused while one runs."""
        if self._profiler is None:
            pc = self.config.parallel_config
            c = pc.layout.replica().coords(self.rank)
            shard = c.pcp if pc.prefill_context_parallel_size > 1 else None
            self._profiler = TraceProfiler(
                f"rank {self.rank}", rank_trace_name(pc.data_parallel_rank, c.pp, c.tp, shard),
                self, "execute_step", RANK_STEP_LABEL, cuda=self.device.type == "cuda")
        self._profiler.start(config)

    def stop_profile(self) -> str:
        """Stop this rank's profile and write its Chrome trace; returns the file's path."""
        if self._profiler is None:
            raise RuntimeError(f"rank {self.rank}: no profile is running; call start_profile "
                               f"first")
        return self._profiler.stop()

    # ---- LoRA adapters (Executor.add_lora etc.; this rank's share of each) ----
    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load and validate the adapter into this rank's cache (False: it was there)."""
        return self._loras().add(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        return self._loras().remove(lora_int_id)

    def pin_lora(self, lora_int_id: int) -> bool:
        """Keep the adapter loaded whatever max_cpu_loras evicts."""
        return self._loras().pin(lora_int_id)

    def list_loras(self) -> list[int]:
        return self._loras().list()

    def _loras(self) -> WorkerLoRAs:
        loras = self._runner().loras
        if loras is None:
            raise ValueError("LoRA is not enabled on this engine; start it with "
                             "enable_lora=True (--enable-lora)")
        return loras

    def shutdown(self) -> None:
        self.model_runner = None
        if self.world_size > 1:
            destroy_distributed()

    def _runner(self) -> ModelRunner:
        if self.model_runner is None:
            raise RuntimeError(f"worker rank {self.rank}: load_model has not run (or shut down)")
        return self.model_runner
