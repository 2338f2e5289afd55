"""The engine's configuration: frozen dataclasses, validated on construction.

`EngineConfig` groups the per-concern configs and is the one object that travels to every worker
(pickled). Values discovered at run time (the number of KV blocks) are not stored here; they live
in `KVCacheConfig`, produced by the engine after asking the workers for their memory. Built from
flat keyword arguments (`LLM(...)`, the CLI) by engine/config_builder.py, which resolves the
model's files first; `group_options` says which config owns each keyword.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from shardserve.config.checks import check as _check
from shardserve.config.lora import LoRAConfig
from shardserve.config.model import DeviceConfig, ModelConfig
from shardserve.config.parallel import MultiNodeConfig, ParallelConfig, RayConfig
from shardserve.config.recovery import RecoveryConfig
from shardserve.config.speculative import SpeculativeConfig

logger = logging.getLogger(__name__)

SCHEDULING_POLICIES = ("fcfs", "priority")


KV_CACHE_DTYPES = ("auto", "bfloat16")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    """Tokens per KV-cache block."""
    kv_cache_memory_bytes: int | None = None
    """KV-cache budget per worker in bytes; overrides kv_cache_memory_fraction."""
    kv_cache_memory_fraction: float = 0.1
    """Fraction of free memory at start-up given to the KV cache (split among a machine's ranks)."""
    num_blocks_override: int | None = None
    """Force this many KV blocks (testing preemption with a tiny cache)."""
    gpu_memory_utilization: float | None = None
    """CUDA: the share of the GPU's memory the engine may fill (the KV cache takes what the
    model leaves of it; overrides kv_cache_memory_fraction there). Ignored on CPU (logged)."""
    swap_space: float | None = None
    """vLLM's CPU swap for preempted requests (GiB): shardserve recomputes them instead, so it
    is accepted and has no effect (logged)."""
    enable_prefix_caching: bool = True
    """Reuse the KV of full blocks whose tokens (and all before them) another request already
    computed; freed blocks keep their contents until evicted, least recently used first."""
    kv_cache_dtype: str = "auto"
    """vLLM's KV-cache dtype: "auto", the cache in the model's activation dtype (float32 or
    bfloat16), or "bfloat16": a float32 model's cache at half the bytes (K and V rounded to
    bfloat16 as they are written; attention reads them widened to float32). fp8 and other cache
    dtypes are refused."""

    def __post_init__(self) -> None:
        _check(
            self.block_size in (1, 2, 4, 8, 16, 32, 64, 128),
            f"block_size={self.block_size!r} must be a power of two in [1, 128]",
        )
        _check(
            self.kv_cache_memory_bytes is None or self.kv_cache_memory_bytes > 0,
            f"kv_cache_memory_bytes={self.kv_cache_memory_bytes!r} must be > 0",
        )
        _check(
            0.0 < self.kv_cache_memory_fraction <= 0.95,
            f"kv_cache_memory_fraction={self.kv_cache_memory_fraction!r} must be in (0, 0.95]",
        )
        _check(
            self.gpu_memory_utilization is None or 0.0 < self.gpu_memory_utilization <= 1.0,
            f"gpu_memory_utilization={self.gpu_memory_utilization!r} must be in (0, 1]",
        )
        _check(
            self.num_blocks_override is None or self.num_blocks_override >= 1,
            f"num_blocks_override={self.num_blocks_override!r} must be >= 1",
        )
        _check(
            self.kv_cache_dtype in KV_CACHE_DTYPES,
            f"kv_cache_dtype={self.kv_cache_dtype!r} is not supported: the KV cache is kept in "
            f"the model's activation dtype ('auto', set by dtype=: float32 or bfloat16) or in "
            f"bfloat16; pass kv_cache_dtype='auto' (or leave it out) or 'bfloat16'",
        )


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 128
    """Most requests in one batch."""
    max_num_batched_tokens: int = 2048
    """Token budget of one step (prefill chunks + decodes)."""
    enable_chunked_prefill: bool = True
    async_scheduling: bool = True
    """Plan step N+1 while step N runs (two steps in flight); the workers feed each request the
    token they sampled themselves. Outputs equal the synchronous engine's."""
    scheduling_policy: str = "fcfs"
    """fcfs: requests run in arrival order; priority: by each request's priority (lower value
    first, ties by arrival), and a full KV cache preempts the least important first."""

    def __post_init__(self) -> None:
        _check(
            self.scheduling_policy in SCHEDULING_POLICIES,
            f"scheduling_policy={self.scheduling_policy!r} is not supported; choose one of: "
            f"{', '.join(SCHEDULING_POLICIES)}",
        )
        _check(
            isinstance(self.async_scheduling, bool),
            f"async_scheduling={self.async_scheduling!r} must be True or False",
        )
        _check(
            isinstance(self.max_num_seqs, int) and self.max_num_seqs >= 1,
            f"max_num_seqs={self.max_num_seqs!r} must be an int >= 1",
        )
        _check(
            isinstance(self.max_num_batched_tokens, int) and self.max_num_batched_tokens >= 1,
            f"max_num_batched_tokens={self.max_num_batched_tokens!r} must be an int >= 1",
        )


@dataclass(frozen=True)
class KVCacheConfig:
    """What the engine decided after asking the workers: sent to `initialize_from_config`."""

    num_blocks: int
    block_size: int


@dataclass(frozen=True)
class ObservabilityConfig:
    disable_log_stats: bool = False
    """Do not log the engine's throughput and queue every 10 s (the server logs them)."""


@dataclass(frozen=True)
class EngineConfig:
    model_config: ModelConfig
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    device_config: DeviceConfig = field(default_factory=DeviceConfig)
    observability_config: ObservabilityConfig = field(default_factory=ObservabilityConfig)
    recovery_config: RecoveryConfig = field(default_factory=RecoveryConfig)
    speculative_config: SpeculativeConfig | dict | str | None = None
    """Speculative decoding without a draft model, as a JSON object on the command line:
    {"method": "ngram", "num_speculative_tokens": 3} (prompt lookup; prompt_lookup_min/max,
    default 5) or {"method": "suffix"} (suffix decoding); see shardserve/config/speculative.py."""
    enable_lora: bool = False
    """Serve LoRA adapters chosen per request (max_loras, max_lora_rank, max_cpu_loras and
    lora_dtype size them); a request naming an adapter is refused without it."""
    lora_config: LoRAConfig | None = None
    """Built from the LoRA options when enable_lora is set; None otherwise."""

    @property
    def kv_cache_torch_dtype(self) -> torch.dtype:
        """The KV cache's element type: the model's activation dtype, or bfloat16 where
        kv_cache_dtype asks it."""
        if self.cache_config.kv_cache_dtype == "bfloat16":
            return torch.bfloat16
        return self.model_config.torch_dtype

    @property
    def virtual_block_size(self) -> int:
        """Tokens per block as the scheduler, the KV-cache manager and the prefix cache count
        them: block_size x decode_context_parallel_size (a block id names one physical block
        of block_size slots on every rank of a DCP group, each holding its share of the
        positions)."""
        return self.cache_config.block_size * self.parallel_config.decode_context_parallel_size

    def __post_init__(self) -> None:
        _resolve_lora(self)
        arch = self.model_config.arch
        tp = self.parallel_config.tensor_parallel_size
        if problem := arch.tp_size_error(tp):
            raise ValueError(f"tensor_parallel_size={tp} cannot shard this model: {problem}")
        pc = self.parallel_config
        _check(
            pc.pipeline_parallel_size <= arch.num_layers,
            f"pipeline_parallel_size={pc.pipeline_parallel_size} exceeds the model's "
            f"{arch.num_layers} layers; every stage needs at least one",
        )
        pc.layer_partition(arch.num_layers)  # validates pp_layer_partition
        _resolve_speculative(self)
        _check_context_parallel(self)
        _note_inapplicable(self)
        sched = self.scheduler_config
        if not sched.enable_chunked_prefill:
            _check(
                sched.max_num_batched_tokens >= self.model_config.max_model_len,
                f"max_num_batched_tokens={sched.max_num_batched_tokens} must be >= max_model_len="
                f"{self.model_config.max_model_len} when chunked prefill is disabled",
            )


def _resolve_lora(config: EngineConfig) -> None:
    """lora_config exists exactly when enable_lora is set (the defaults when no LoRA option
    was given), so every layer tests `lora_config is not None` alone."""
    _check(isinstance(config.enable_lora, bool),
           f"enable_lora={config.enable_lora!r} must be True or False")
    if not config.enable_lora:
        if config.lora_config is not None and config.lora_config != LoRAConfig():
            logger.info("LoRA options (%s) have no effect without enable_lora=True",
                        config.lora_config)
        object.__setattr__(config, "lora_config", None)
    elif config.lora_config is None:
        object.__setattr__(config, "lora_config", LoRAConfig())


def _resolve_speculative(config: EngineConfig) -> None:
    """speculative_config as a SpeculativeConfig (from a dict or JSON), checked against the
    rest: drafts are verified as extra query positions of a generating request."""
    spec = SpeculativeConfig.from_dict(config.speculative_config)
    object.__setattr__(config, "speculative_config", spec)
    if spec is None:
        return
    _check(not config.model_config.is_pooling,
           "speculative_config applies to runner='generate' only (pooling samples no tokens); "
           "drop it or set runner='generate'")
    k, max_len = spec.num_speculative_tokens, config.model_config.max_model_len
    _check(k < max_len, f"num_speculative_tokens={k} must be < max_model_len={max_len}")
    budget = config.scheduler_config.max_num_batched_tokens
    _check(k + 1 <= budget, f"num_speculative_tokens={k} needs max_num_batched_tokens >= "
           f"{k + 1} (a verify step feeds 1 + k positions), got {budget}")


def _check_context_parallel(config: EngineConfig) -> None:
    """What context parallelism does not combine with yet, and its interleave against the
    block size (a block holds whole interleave runs)."""
    pc, block_size = config.parallel_config, config.cache_config.block_size
    interleave = pc.cp_kv_cache_interleave_size
    _check(block_size % interleave == 0,
           f"cp_kv_cache_interleave_size={interleave} must divide block_size={block_size} "
           f"(a block holds whole runs of consecutive positions); use a divisor of "
           f"{block_size}, e.g. 1")
    if not pc.context_parallel:
        return
    sizes = (f"decode_context_parallel_size={pc.decode_context_parallel_size}, "
             f"prefill_context_parallel_size={pc.prefill_context_parallel_size}")
    _check(config.speculative_config is None,
           f"speculative decoding is not supported with context parallelism yet ({sizes}); "
           f"drop speculative_config or set both sizes to 1")
    _check(not config.enable_lora,
           f"LoRA (enable_lora=True) is not supported with context parallelism yet ({sizes}); "
           f"drop enable_lora or set both sizes to 1")
    _check(config.cache_config.kv_cache_dtype == "auto",
           f"kv_cache_dtype={config.cache_config.kv_cache_dtype!r} is not supported with context "
           f"parallelism yet ({sizes}); use kv_cache_dtype='auto' or set both sizes to 1")
    _check(not config.model_config.is_pooling or pc.prefill_context_parallel_size == 1,
           f"runner='pooling' is not supported with prefill_context_parallel_size="
           f"{pc.prefill_context_parallel_size} (pooling reads every prompt position on one "
           f"rank); set prefill_context_parallel_size=1")


# Which config owns a flat option; the nested Ray and multi-node configs belong to
# ParallelConfig; EngineConfig owns the options that are no sub-config (speculative_config).
# ModelConfig's resolved fields (path, arch...) are not options.
OWNERS: dict[str, type] = {
    "device_config": DeviceConfig,
    "model_config": ModelConfig,
    "cache_config": CacheConfig,
    "parallel_config": ParallelConfig,
    "ray": RayConfig,
    "multinode": MultiNodeConfig,
    "scheduler_config": SchedulerConfig,
    "observability_config": ObservabilityConfig,
    "recovery_config": RecoveryConfig,
    "lora_config": LoRAConfig,
    "engine_config": EngineConfig,
}
NOT_OPTIONS = {ModelConfig: {"model", "device", "path", "arch", "tokenizer_path"},
                ParallelConfig: {"ray", "multinode"}, MultiNodeConfig: {"cluster_secret"},
                # the sub-configs are built from their own options, not passed whole
                EngineConfig: {f.name for f in dataclasses.fields(EngineConfig)
                               if f.name.endswith("_config") and f.name != "speculative_config"}}


def option_names(cls: type) -> set[str]:
    hidden = NOT_OPTIONS.get(cls, set())
    return {f.name for f in dataclasses.fields(cls) if f.init and f.name not in hidden}


def group_options(kwargs: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Flat engine options -> {owner: its keyword arguments}; unknown names are refused."""
    groups: dict[str, dict[str, Any]] = {}
    for key, value in kwargs.items():
        owner = next((g for g, c in OWNERS.items() if key in option_names(c)), None)
        if owner is None:
            valid = sorted(k for c in OWNERS.values() for k in option_names(c))
            raise TypeError(f"unknown engine option {key!r}; valid options: {', '.join(valid)}")
        groups.setdefault(owner, {})[key] = value
    return groups


def _note_inapplicable(config: EngineConfig) -> None:
    """Options a vLLM user passes that do nothing here: accepted, and said once."""
    cache, device = config.cache_config, config.device_config.device
    notes = []
    if cache.gpu_memory_utilization is not None and device != "cuda":
        notes.append(f"gpu_memory_utilization={cache.gpu_memory_utilization} applies on CUDA "
                     f"only; on CPU the KV cache takes kv_cache_memory_fraction / "
                     f"kv_cache_memory_bytes")
    if cache.swap_space is not None:
        notes.append(f"swap_space={cache.swap_space} has no effect: preempted requests are "
                     f"recomputed, never swapped")
    if config.model_config.enforce_eager:
        notes.append("enforce_eager=True changes nothing: shardserve always runs eagerly")
    for note in notes:
        if note not in _NOTED:
            _NOTED.add(note)
            logger.info("%s", note)


_NOTED: set[str] = set()
