"""How many ranks, where they run: the parallel sizes, and Ray's and multi-node's settings in
configs of their own. Rank arithmetic lives in `distributed/rank_layout.py` (`.layout`)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cached_property

from shardserve.config.backends import BACKENDS, CP_BACKENDS, PP_BACKENDS
from shardserve.config.checks import check
from shardserve.distributed.rank_layout import RankLayout

_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


@dataclass(frozen=True)
class RayConfig:
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

    def __post_init__(self) -> None:
        for name in ("ray_placement_timeout_s", "ray_cpus_per_worker"):
            check(getattr(self, name) > 0, f"{name}={getattr(self, name)!r} must be > 0")
        check(self.ray_placement_strategy in _STRATEGIES,
              f"ray_placement_strategy={self.ray_placement_strategy!r} must be one of "
              f"{', '.join(_STRATEGIES)}")
        extra = self.ray_bundle_resources
        if isinstance(extra, str):  # from the command line
            try:
                extra = json.loads(extra)
            except json.JSONDecodeError as e:
                raise ValueError(f"ray_bundle_resources={extra!r} is not JSON: {e}") from e
            object.__setattr__(self, "ray_bundle_resources", extra)
        check(extra is None or (isinstance(extra, dict) and all(
                  isinstance(k, str) and isinstance(v, int | float) and v >= 0
                  for k, v in extra.items())),
              f"ray_bundle_resources={extra!r} must map resource names to numbers >= 0")


@dataclass(frozen=True)
class MultiNodeConfig:
    nnodes: int = 1
    """Machines the ranks span (mp backend). The ranks of every replica are spread evenly,
    node-major (see RankLayout). Node 0 runs the front end and every engine core; every other
    node runs `shardserve serve --headless` with its node_rank."""
    node_rank: int = 0
    """This machine's index among the nnodes (0: the engine's node)."""
    master_addr: str = "127.0.0.1"
    """Node 0's address as the other nodes reach it (multi-node handshake and torch.distributed)."""
    master_port: int = 29555
    """Node 0's port for the multi-node handshake of replica 0 (replica i: master_port + i),
    authenticated by SHARDSERVE_CLUSTER_SECRET."""
    cluster_secret: str | None = field(default=None, repr=False, compare=False)
    """Not an option (SHARDSERVE_CLUSTER_SECRET is the user's way to give it): the secret node 0
    resolved, carried to its engine cores (executor/multinode/secret.py)."""

    def __post_init__(self) -> None:
        check(isinstance(self.nnodes, int) and self.nnodes >= 1,
              f"nnodes={self.nnodes!r} must be an int >= 1")
        check(0 <= self.node_rank < self.nnodes,
              f"node_rank={self.node_rank!r} must be in 0..nnodes-1 ({self.nnodes - 1})")
        check(0 < self.master_port < 65536, f"master_port={self.master_port!r} is not a port")


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
    data_parallel_size: int = 1
    """Engine replicas, each an engine core in its own process with its own executor (and its
    own pipeline x prefill context x tensor parallel ranks); requests go to the least loaded.
    Replicas on one machine split its cores and its CPU KV-cache budget."""
    data_parallel_backend: str = "mp"
    """Where replicas' ranks run: "mp" (this machine, or the nodes of nnodes) or "ray" (each
    replica's ranks in a Ray placement group of its own, on whatever nodes Ray chooses; the
    engine cores stay beside the front end, and the executor is 'ray' unless 'ray_v2' is
    asked for)."""
    data_parallel_rank: int = 0
    """Which replica this engine core is (set by the front end on each replica's copy)."""
    pp_layer_partition: str | None = None
    """Decoder layers per pipeline stage, comma-separated ("10,10,10"; a list of ints is taken
    too); they must sum to the model's layer count, each >= 1. None: split evenly (earlier
    stages take the remainder)."""
    decode_context_parallel_size: int = 1
    """Decode context parallelism (DCP): the KV cache of every sequence is sharded by position
    over this many of the TP ranks (it must divide tensor_parallel_size), so each rank holds
    1/DCP of it and the engine admits ~DCP x the tokens; attention merges the shards' partial
    results. Needs no extra ranks."""
    prefill_context_parallel_size: int = 1
    """Prefill context parallelism (PCP): every prefill is split across this many groups of TP
    ranks (causally load balanced), to cut time to first token of long prompts. Multiplies the
    ranks: PP x PCP x TP per replica."""
    cp_kv_cache_interleave_size: int = 1
    """Decode context parallelism: consecutive positions stored together on one rank before
    the next rank takes over (1: round robin by token); must divide block_size."""
    ray: RayConfig = field(default_factory=RayConfig)
    multinode: MultiNodeConfig = field(default_factory=MultiNodeConfig)

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size",
                     *_CP_SIZES):
            value = getattr(self, name)
            check(isinstance(value, int) and value >= 1, f"{name}={value!r} must be an int >= 1")
        self._check_context_parallel()
        check(self.data_parallel_backend in ("mp", "ray"),
              f"data_parallel_backend={self.data_parallel_backend!r} must be 'mp' or 'ray'")
        check(isinstance(self.data_parallel_rank, int)
              and 0 <= self.data_parallel_rank < self.data_parallel_size,
              f"data_parallel_rank={self.data_parallel_rank!r} must be in "
              f"0..data_parallel_size-1; the front end sets it on each replica's copy of the "
              f"config: leave it at 0")
        if isinstance(self.pp_layer_partition, list | tuple):  # kept as text: hashable, printable
            text = ",".join(str(n) for n in self.pp_layer_partition)
            object.__setattr__(self, "pp_layer_partition", text)
        if self.distributed_executor_backend is None:
            object.__setattr__(self, "distributed_executor_backend", self._default_backend())
        if self.data_parallel_backend == "ray":
            self._check_ray_replicas()
        self._check_backend()
        for name in ("worker_start_timeout_s", "execute_timeout_s"):
            check(getattr(self, name) > 0, f"{name}={getattr(self, name)!r} must be > 0")
        self._check_nodes()

    def _default_backend(self) -> str:
        if self.data_parallel_backend == "ray":
            return "ray"
        # Across nodes even one rank may live elsewhere: only mp reaches it.
        return "uni" if self.world_size == 1 and self.multinode.nnodes == 1 else "mp"

    def _check_backend(self) -> None:
        backend = self.distributed_executor_backend
        check(not isinstance(backend, str) or backend in BACKENDS or "." in backend,
              f"distributed_executor_backend={backend!r} is not known; choose one of "
              f"{', '.join(BACKENDS)}, an Executor subclass or its dotted path "
              f"'pkg.module.Class'")
        entry = BACKENDS.get(backend) if isinstance(backend, str) else None
        if entry is None:
            return
        check(entry.supports_cp or not self.context_parallel,
              f"distributed_executor_backend={backend!r} does not run context parallelism "
              f"(decode_context_parallel_size={self.decode_context_parallel_size}, "
              f"prefill_context_parallel_size={self.prefill_context_parallel_size}); the "
              f"backends that take it: {', '.join(CP_BACKENDS)}")
        check(entry.supports_pp or self.pipeline_parallel_size == 1,
              f"pipeline_parallel_size={self.pipeline_parallel_size} needs several processes; "
              f"the backends that take it: {', '.join(PP_BACKENDS)}")
        check(entry.multi_rank or self.world_size == 1,
              f"distributed_executor_backend={backend!r} runs one rank, but "
              f"{self.world_formula} = {self.world_size}; use 'mp' or 'ray'")

    def _check_context_parallel(self) -> None:
        """vLLM's rules: DCP reuses the TP ranks (or, with PCP, the PCP or TP x PCP ones)."""
        tp, dcp = self.tensor_parallel_size, self.decode_context_parallel_size
        pcp = self.prefill_context_parallel_size
        if pcp == 1:
            check(tp % dcp == 0,
                  f"decode_context_parallel_size={dcp} must divide tensor_parallel_size={tp} "
                  f"(decode context parallelism shards the KV cache over the TP ranks); use a "
                  f"divisor of {tp} or raise tensor_parallel_size")
            return
        allowed = sorted({1, pcp, tp * pcp})
        check(dcp in allowed,
              f"with prefill_context_parallel_size={pcp} and tensor_parallel_size={tp}, "
              f"decode_context_parallel_size={dcp} must be 1, PCP or TP x PCP: one of "
              f"{allowed}")

    def _check_ray_replicas(self) -> None:
        check(self.distributed_executor_backend in ("ray", "ray_v2"),
              f"data_parallel_backend='ray' puts each replica's ranks in a placement group: "
              f"distributed_executor_backend must be 'ray' or 'ray_v2' (or unset), got "
              f"{self.distributed_executor_backend!r}")
        check(self.ray.ray_placement_group is None or self.data_parallel_size == 1,
              f"ray_placement_group={self.ray.ray_placement_group!r} would put every replica in "
              f"the same group; with data_parallel_backend='ray' each replica creates its own")
        check(self.multinode.nnodes == 1, "data_parallel_backend='ray' spans nodes through Ray: "
              f"leave nnodes at 1 (got {self.multinode.nnodes})")

    def _check_nodes(self) -> None:
        nnodes = self.multinode.nnodes
        if nnodes == 1:
            return
        check(self.distributed_executor_backend == "mp",
              f"nnodes={nnodes} needs distributed_executor_backend='mp' (got "
              f"{self.distributed_executor_backend!r}); across Ray nodes use 'ray' or 'ray_v2'")
        total = self.world_size * self.data_parallel_size
        check(total % nnodes == 0,
              f"nnodes={nnodes} must divide data_parallel_size x {self.world_formula} = "
              f"{total} (ranks are spread evenly over the nodes)")

    @property
    def world_size(self) -> int:
        """Ranks of one replica (its torch.distributed world): PP x PCP x TP (DCP reuses them)."""
        return (self.pipeline_parallel_size * self.prefill_context_parallel_size
                * self.tensor_parallel_size)

    @property
    def world_formula(self) -> str:
        """How world_size is made, for messages: the sizes that multiply into it."""
        names = ["tensor_parallel_size", "pipeline_parallel_size"]
        if self.prefill_context_parallel_size > 1:
            names.insert(1, "prefill_context_parallel_size")
        return " x ".join(names)

    @property
    def context_parallel(self) -> bool:
        """Either kind of context parallelism is on (DCP > 1 or PCP > 1)."""
        return self.decode_context_parallel_size > 1 or self.prefill_context_parallel_size > 1

    @cached_property
    def layout(self) -> RankLayout:
        """Every replica's ranks: coordinates, groups, nodes (distributed/rank_layout.py)."""
        return RankLayout(tp=self.tensor_parallel_size, pp=self.pipeline_parallel_size,
                          pcp=self.prefill_context_parallel_size, dp=self.data_parallel_size,
                          dcp=self.decode_context_parallel_size, nnodes=self.multinode.nnodes)

    def describe_rank(self, rank: int, where: str) -> str:
        """'rank 3 (pid 7)' or, with pipeline stages, 'rank 3 (stage 1, TP rank 1, pid 7)'."""
        return self.layout.describe(rank, where)

    def layer_partition(self, num_layers: int) -> list[int]:
        """Decoder layers per stage: pp_layer_partition, or an even split (remainder first)."""
        pp = self.pipeline_parallel_size
        counts = (_even_split(num_layers, pp) if self.pp_layer_partition is None
                  else _parse_partition(self.pp_layer_partition))
        check(len(counts) == pp and sum(counts) == num_layers and min(counts) >= 1,
              f"pp_layer_partition={self.pp_layer_partition!r} gives {counts}: it needs "
              f"pipeline_parallel_size={pp} entries, each >= 1, summing to the model's "
              f"{num_layers} layers (e.g. "
              f"{','.join(map(str, _even_split(num_layers, max(pp, 1))))!r})")
        return counts

    def stage_layers(self, stage: int, num_layers: int) -> tuple[int, int]:
        """[start, end) of the decoder layers that `stage` holds."""
        counts = self.layer_partition(num_layers)
        start = sum(counts[:stage])
        return start, start + counts[stage]


_CP_SIZES = ("decode_context_parallel_size", "prefill_context_parallel_size",
             "cp_kv_cache_interleave_size")


def _even_split(num_layers: int, pp: int) -> list[int]:
    base, extra = divmod(num_layers, pp)
    return [base + (1 if s < extra else 0) for s in range(pp)]


def _parse_partition(text: str) -> list[int]:
    try:
        return [int(part) for part in str(text).split(",")]
    except ValueError as e:
        raise ValueError(
            f"pp_layer_partition={text!r} must be comma-separated layer counts like '10,10,10'"
        ) from e
