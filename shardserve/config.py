"""Engine configuration: frozen dataclasses, validated on construction.

`EngineConfig` groups the per-concern configs and is the one object that travels to every worker
(pickled). Values discovered at run time (the number of KV blocks) are not stored here; they live
in `KVCacheConfig`, produced by the engine after asking the workers for their memory.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from shardserve.model.arch import ModelArch

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}
BACKENDS = ("uni", "mp", "ray", "ray_v2", "external_launcher")
PP_BACKENDS = ("mp", "ray", "ray_v2", "external_launcher")


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


@functools.cache
def cpu_has_native_bf16() -> bool:
    """True where the CPU computes bfloat16 natively (AVX512-BF16 or AMX); else fp32 is faster."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


QUANTIZATIONS = ("auto", "gguf", "int8", "none")


def resolve_dtype(dtype: str | torch.dtype, device: str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if device == "cuda" or cpu_has_native_bf16():
            return torch.bfloat16
        return torch.float32
    _check(
        dtype in _DTYPES,
        f"dtype={dtype!r} is not supported; choose one of: auto, {', '.join(_DTYPES)}",
    )
    return _DTYPES[dtype]


logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DeviceConfig:
    device: str = "auto"
    """'cpu', 'cuda' or 'auto' (cuda when available)."""

    def __post_init__(self) -> None:
        _check(
            self.device in ("auto", "cpu", "cuda"),
            f"device={self.device!r} is not supported; choose auto, cpu or cuda",
        )
        if self.device == "auto":
            object.__setattr__(self, "device", "cuda" if torch.cuda.is_available() else "cpu")
        if self.device == "cuda":
            _check(torch.cuda.is_available(), "device='cuda' but no CUDA device is visible")


@dataclass(frozen=True)
class ModelConfig:
    model: str | None = None
    """HF model folder or .gguf file; None selects the default model (SmolLM2-135M-Instruct)."""
    tokenizer: str | None = None
    """Tokenizer folder or .gguf file; defaults to the model's own."""
    dtype: str = "auto"
    """auto (bfloat16 where the hardware computes it natively, else float32), float32,
    bfloat16 or float16."""
    max_model_len: int | None = None
    """Longest sequence (prompt + output); defaults to the model's max positions."""
    seed: int = 0
    """Seed of the random source for requests without their own seed."""
    trust_remote_code: bool = False
    """Let the tokenizer run code from the model folder (transformers' auto_map)."""
    tokenizer_mode: str = "auto"
    """auto or hf: the model's fast (tokenizer.json) tokenizer (vLLM's slow, mistral and custom
    modes are refused)."""
    enforce_eager: bool = False
    """vLLM's switch off CUDA graphs: shardserve runs eagerly always, so it changes nothing."""
    quantization: str = "auto"
    """gguf: compute with a GGUF file's quantized blocks as stored (Q4_0, Q4_1, Q8_0, Q4_K,
    Q5_K, Q6_K; other types are dequantized); int8: quantize the decoder's linear weights per
    output channel at load; none: dequantize everything to dtype. auto: gguf for a quantized
    GGUF file when dtype is auto, else none. CPU only. Resolved to the chosen one at init."""
    device: str = "cpu"
    path: Path = field(init=False)
    tokenizer_path: Path = field(init=False)
    arch: ModelArch = field(init=False)

    def __post_init__(self) -> None:
        from shardserve.model.loader import read_arch, resolve_model_path

        path = resolve_model_path(self.model)
        object.__setattr__(self, "path", path)
        tok = resolve_model_path(self.tokenizer) if self.tokenizer is not None else path
        object.__setattr__(self, "tokenizer_path", tok)
        object.__setattr__(self, "arch", read_arch(path))
        resolve_dtype(self.dtype, self.device)  # validates the name
        object.__setattr__(self, "quantization", self._resolve_quantization(path))
        max_pos = self.arch.max_position_embeddings
        if self.max_model_len is None:
            object.__setattr__(self, "max_model_len", max_pos)
        _check(
            isinstance(self.max_model_len, int) and 1 <= self.max_model_len <= max_pos,
            f"max_model_len={self.max_model_len!r} must be an int in [1, {max_pos}] "
            f"(the model's max_position_embeddings)",
        )
        _check(isinstance(self.seed, int), f"seed={self.seed!r} must be an int")
        _check(self.tokenizer_mode in ("auto", "hf"),
               f"tokenizer_mode={self.tokenizer_mode!r} is not supported; use auto (or hf): "
               f"the model's fast tokenizer")

    @property
    def torch_dtype(self) -> torch.dtype:
        return resolve_dtype(self.dtype, self.device)

    def _resolve_quantization(self, path: Path) -> str:
        from shardserve.model.gguf_loader import has_kept_quantized_weights

        choice = self.quantization
        _check(choice in QUANTIZATIONS,
               f"quantization={choice!r} is not supported; choose one of: "
               f"{', '.join(QUANTIZATIONS)}")
        is_gguf = path.is_file()
        if choice == "auto":
            quantized = is_gguf and self.dtype == "auto" and self.device != "cuda"
            return "gguf" if quantized and has_kept_quantized_weights(path) else "none"
        _check(choice != "gguf" or is_gguf,
               f"quantization='gguf' needs a .gguf model file, got the folder {str(path)!r}; "
               f"use quantization='int8' to quantize its weights at load, or 'none'")
        _check(choice == "none" or self.device != "cuda",
               f"quantization={choice!r} runs on CPUs only; use quantization='none' on cuda")
        return choice


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


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    distributed_executor_backend: str | type | None = None
    """uni | mp | ray | ray_v2 | external_launcher | an Executor subclass or its dotted path.
    Default: uni for one rank, mp for more."""
    worker_start_timeout_s: float = 120.0
    """Deadline for every worker to load its model and report ready."""
    execute_timeout_s: float = 300.0
    """Deadline for one execute_model / sample_tokens call to answer."""
    worker_cls: str = "shardserve.worker.worker.Worker"
    """Dotted path of the Worker class each rank runs (a subclass may add methods)."""
    ray_address: str | None = None
    """Ray cluster to join ('auto', 'host:port', 'ray://...') for the ray backends. None: the
    Ray already initialised in this process, else RAY_ADDRESS, else a local Ray started (and
    stopped at shutdown) by the executor."""
    ray_placement_group: str | None = None
    """Name of an existing Ray placement group to place the ranks in (one bundle per rank, in
    order). None: the placement group this process runs in, else one created per engine."""
    ray_placement_strategy: str = "PACK"
    """Strategy of a placement group the executor creates: PACK, SPREAD, STRICT_PACK or
    STRICT_SPREAD."""
    ray_placement_timeout_s: float = 60.0
    """Deadline for the placement group to be scheduled; the error lists the bundles asked
    for and every node's free resources."""
    ray_cpus_per_worker: float = 1.0
    """Logical CPUs reserved per rank (each bundle and actor); also its torch thread count."""
    ray_bundle_resources: dict[str, float] | None = None
    """Extra Ray resources each rank's bundle asks for (e.g. a custom node label); a JSON
    object string is accepted too."""
    ray_use_compiled_graph: bool | None = None
    """ray backend: run model steps through a Ray Compiled Graph instead of actor calls. None:
    only where cores outnumber workers (compiled-graph readers poll, about a core each)."""
    data_parallel_size: int = 1
    """Engine replicas, each an engine core in its own process with its own executor (and its
    own tensor_parallel_size x pipeline_parallel_size ranks); requests go to the least loaded.
    Replicas on one machine split its cores and its CPU KV-cache budget."""
    data_parallel_backend: str = "mp"
    """Where replicas' ranks run: "mp" (this machine, or the nodes of nnodes) or "ray" (each
    replica's ranks in a Ray placement group of its own, on whatever nodes Ray chooses; the
    engine cores stay beside the front end, and the executor is 'ray' unless 'ray_v2' is
    asked for)."""
    data_parallel_rank: int = 0
    """Which replica this engine core is (set by the front end on each replica's copy)."""
    nnodes: int = 1
    """Machines the ranks span (mp backend). The ranks of every replica (replica i's rank r is
    number i x world_size + r) are spread evenly, node-major: node n holds numbers n*L ..
    (n+1)*L-1, L = data_parallel_size x world_size / nnodes. Node 0 runs the front end and
    every engine core; every other node runs `shardserve serve --headless` with its node_rank."""
    node_rank: int = 0
    """This machine's index among the nnodes (0: the engine's node)."""
    master_addr: str = "127.0.0.1"
    """Node 0's address as the other nodes reach it (multi-node handshake and torch.distributed)."""
    master_port: int = 29555
    """Node 0's port for the multi-node handshake of replica 0 (replica i: master_port + i),
    authenticated by SHARDSERVE_CLUSTER_SECRET."""
    pp_layer_partition: str | None = None
    """Decoder layers per pipeline stage, comma-separated ("10,10,10"; a list of ints is taken
    too); they must sum to the model's layer count, each >= 1. None: split evenly (earlier
    stages take the remainder)."""

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
            value = getattr(self, name)
            _check(isinstance(value, int) and value >= 1, f"{name}={value!r} must be an int >= 1")
        _check(
            self.data_parallel_backend in ("mp", "ray"),
            f"data_parallel_backend={self.data_parallel_backend!r} must be 'mp' or 'ray'",
        )
        _check(isinstance(self.data_parallel_rank, int)
               and 0 <= self.data_parallel_rank < self.data_parallel_size,
               f"data_parallel_rank={self.data_parallel_rank!r} must be in "
               f"0..data_parallel_size-1; the front end sets it on each replica's copy of the "
               f"config: leave it at 0")
        if isinstance(self.pp_layer_partition, list | tuple):  # kept as text: hashable, printable
            text = ",".join(str(n) for n in self.pp_layer_partition)
            object.__setattr__(self, "pp_layer_partition", text)
        if self.distributed_executor_backend is None:
            # Across nodes even one rank may live elsewhere: only mp reaches it.
            backend = "uni" if self.world_size == 1 and self.nnodes == 1 else "mp"
            if self.data_parallel_backend == "ray":
                backend = "ray"
            object.__setattr__(self, "distributed_executor_backend", backend)
        if self.data_parallel_backend == "ray":
            self._check_ray_replicas()
        backend = self.distributed_executor_backend
        _check(
            not isinstance(backend, str) or backend in BACKENDS or "." in backend,
            f"distributed_executor_backend={backend!r} is not known; choose one of "
            f"{', '.join(BACKENDS)}, an Executor subclass or its dotted path 'pkg.module.Class'",
        )
        if backend == "uni":
            _check(
                self.pipeline_parallel_size == 1,
                f"pipeline_parallel_size={self.pipeline_parallel_size} needs several processes; "
                f"the backends that take it: {', '.join(PP_BACKENDS)}",
            )
            _check(
                self.world_size == 1,
                f"distributed_executor_backend='uni' runs one rank, but tensor_parallel_size x "
                f"pipeline_parallel_size = {self.world_size}; use 'mp' or 'ray'",
            )
        for name in (
            "worker_start_timeout_s",
            "execute_timeout_s",
            "ray_placement_timeout_s",
            "ray_cpus_per_worker",
        ):
            _check(getattr(self, name) > 0, f"{name}={getattr(self, name)!r} must be > 0")
        self._check_ray_fields()
        self._check_nodes()

    def _check_ray_replicas(self) -> None:
        _check(self.distributed_executor_backend in ("ray", "ray_v2"),
               f"data_parallel_backend='ray' puts each replica's ranks in a placement group: "
               f"distributed_executor_backend must be 'ray' or 'ray_v2' (or unset), got "
               f"{self.distributed_executor_backend!r}")
        _check(self.ray_placement_group is None or self.data_parallel_size == 1,
               f"ray_placement_group={self.ray_placement_group!r} would put every replica in the "
               f"same group; with data_parallel_backend='ray' each replica creates its own")
        _check(self.nnodes == 1, "data_parallel_backend='ray' spans nodes through Ray: leave "
               f"nnodes at 1 (got {self.nnodes})")

    def _check_nodes(self) -> None:
        _check(isinstance(self.nnodes, int) and self.nnodes >= 1,
               f"nnodes={self.nnodes!r} must be an int >= 1")
        _check(0 <= self.node_rank < self.nnodes,
               f"node_rank={self.node_rank!r} must be in 0..nnodes-1 ({self.nnodes - 1})")
        _check(0 < self.master_port < 65536, f"master_port={self.master_port!r} is not a port")
        if self.nnodes == 1:
            return
        _check(self.distributed_executor_backend == "mp",
               f"nnodes={self.nnodes} needs distributed_executor_backend='mp' (got "
               f"{self.distributed_executor_backend!r}); across Ray nodes use 'ray' or 'ray_v2'")
        total = self.world_size * self.data_parallel_size
        _check(total % self.nnodes == 0,
               f"nnodes={self.nnodes} must divide data_parallel_size x tensor_parallel_size x "
               f"pipeline_parallel_size = {total} (ranks are spread evenly over the nodes)")

    @property
    def ranks_per_node(self) -> int:
        """Ranks each machine holds, over every replica."""
        return self.world_size * self.data_parallel_size // self.nnodes

    def node_of(self, rank: int, replica: int | None = None) -> int:
        """The node of rank `rank` of replica `replica` (default: this config's replica)."""
        replica = self.data_parallel_rank if replica is None else replica
        return (replica * self.world_size + rank) // self.ranks_per_node

    def local_rank_of(self, rank: int, replica: int | None = None) -> int:
        """Rank `rank`'s index among every replica's ranks on its machine (its CUDA device)."""
        replica = self.data_parallel_rank if replica is None else replica
        number = replica * self.world_size + rank
        return number - self.node_of(rank, replica) * self.ranks_per_node

    def ranks_on_node(self, node: int, replica: int | None = None) -> tuple[int, ...]:
        """Replica `replica`'s ranks on `node` (consecutive; node 0's are a prefix)."""
        return tuple(r for r in range(self.world_size) if self.node_of(r, replica) == node)

    def _check_ray_fields(self) -> None:
        strategies = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
        _check(
            self.ray_placement_strategy in strategies,
            f"ray_placement_strategy={self.ray_placement_strategy!r} must be one of "
            f"{', '.join(strategies)}",
        )
        extra = self.ray_bundle_resources
        if isinstance(extra, str):  # from the command line
            try:
                extra = json.loads(extra)
            except json.JSONDecodeError as e:
                raise ValueError(f"ray_bundle_resources={extra!r} is not JSON: {e}") from e
            object.__setattr__(self, "ray_bundle_resources", extra)
        _check(
            extra is None
            or (
                isinstance(extra, dict)
                and all(
                    isinstance(k, str) and isinstance(v, int | float) and v >= 0
                    for k, v in extra.items()
                )
            ),
            f"ray_bundle_resources={extra!r} must map resource names to numbers >= 0",
        )

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def stage_of(self, rank: int) -> int:
        """Pipeline stage of a global rank (rank = stage x TP + tp_rank)."""
        return rank // self.tensor_parallel_size

    def describe_rank(self, rank: int, where: str) -> str:
        """'rank 3 (pid 7)' or, with pipeline stages, 'rank 3 (stage 1, TP rank 1, pid 7)'."""
        if self.pipeline_parallel_size == 1:
            return f"rank {rank} ({where})"
        tp = self.tensor_parallel_size
        return f"rank {rank} (stage {rank // tp}, TP rank {rank % tp}, {where})"

    def layer_partition(self, num_layers: int) -> list[int]:
        """Decoder layers per stage: pp_layer_partition, or an even split (remainder first)."""
        pp = self.pipeline_parallel_size
        if self.pp_layer_partition is None:
            base, extra = divmod(num_layers, pp)
            counts = [base + (1 if s < extra else 0) for s in range(pp)]
        else:
            counts = _parse_partition(self.pp_layer_partition)
        _check(
            len(counts) == pp and sum(counts) == num_layers and min(counts) >= 1,
            f"pp_layer_partition={self.pp_layer_partition!r} gives {counts}: it needs "
            f"pipeline_parallel_size={pp} entries, each >= 1, summing to the model's "
            f"{num_layers} layers (e.g. {_even_example(num_layers, pp)!r})",
        )
        return counts

    def stage_layers(self, stage: int, num_layers: int) -> tuple[int, int]:
        """[start, end) of the decoder layers that `stage` holds."""
        counts = self.layer_partition(num_layers)
        start = sum(counts[:stage])
        return start, start + counts[stage]


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

    def __post_init__(self) -> None:
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

    def __post_init__(self) -> None:
        arch = self.model_config.arch
        tp = self.parallel_config.tensor_parallel_size
        if tp not in arch.valid_tp_sizes(max(tp, 1)):
            raise ValueError(
                f"tensor_parallel_size={tp} cannot shard this model ({arch.num_heads} attention "
                f"heads, {arch.num_kv_heads} KV heads); sizes that divide both: "
                f"{arch.valid_tp_sizes(16)}"
            )
        pc = self.parallel_config
        _check(
            pc.pipeline_parallel_size <= arch.num_layers,
            f"pipeline_parallel_size={pc.pipeline_parallel_size} exceeds the model's "
            f"{arch.num_layers} layers; every stage needs at least one",
        )
        pc.layer_partition(arch.num_layers)  # validates pp_layer_partition
        _note_inapplicable(self)
        sched = self.scheduler_config
        if not sched.enable_chunked_prefill:
            _check(
                sched.max_num_batched_tokens >= self.model_config.max_model_len,
                f"max_num_batched_tokens={sched.max_num_batched_tokens} must be >= max_model_len="
                f"{self.model_config.max_model_len} when chunked prefill is disabled",
            )

    @classmethod
    def from_kwargs(cls, model: str | None = None, **kwargs: Any) -> EngineConfig:
        """Build from flat keyword arguments, as `LLM(...)` and the CLI take them."""
        groups: dict[str, dict[str, Any]] = {}
        owners = {
            "device_config": DeviceConfig,
            "model_config": ModelConfig,
            "cache_config": CacheConfig,
            "parallel_config": ParallelConfig,
            "scheduler_config": SchedulerConfig,
            "observability_config": ObservabilityConfig,
        }
        for key, value in kwargs.items():
            owner = next((g for g, c in owners.items() if key in _init_fields(c)), None)
            if owner is None:
                valid = sorted(k for c in owners.values() for k in _init_fields(c))
                raise TypeError(f"unknown engine option {key!r}; valid options: {', '.join(valid)}")
            groups.setdefault(owner, {})[key] = value
        device = DeviceConfig(**groups.pop("device_config", {}))
        model_kwargs = groups.pop("model_config", {})
        model_config = ModelConfig(model=model, device=device.device, **model_kwargs)
        built = {name: owners[name](**kw) for name, kw in groups.items()}
        return cls(model_config=model_config, device_config=device, **built)


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


def _parse_partition(text: str | list[int] | tuple[int, ...]) -> list[int]:
    parts = text if isinstance(text, list | tuple) else str(text).split(",")
    try:
        return [int(part) for part in parts]
    except ValueError as e:
        raise ValueError(
            f"pp_layer_partition={text!r} must be comma-separated layer counts like '10,10,10'"
        ) from e


def _even_example(num_layers: int, pp: int) -> str:
    base, extra = divmod(num_layers, max(pp, 1))
    return ",".join(str(base + (1 if s < extra else 0)) for s in range(max(pp, 1)))


def _init_fields(cls: type) -> set[str]:
    # ModelConfig's `model` is positional in from_kwargs and its `device` comes from DeviceConfig.
    hidden = ("model", "device") if cls is ModelConfig else ()
    return {f.name for f in dataclasses.fields(cls) if f.init and f.name not in hidden}
