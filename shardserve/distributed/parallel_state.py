"""Process groups: tensor parallelism within a pipeline stage, and the pipeline itself.

Model layers call `get_tp_group()` and use only `.rank`, `.world_size`, `.all_reduce` and
`.all_gather`. At world size 1 (the default, before `init_distributed`) every collective is the
identity, so the same layer code runs unsharded in one process. The model runner calls
`get_pp_group()` for its stage and the hand-off of hidden states between stages.

The groups come from the replica's RankLayout (rank_layout.py): TP groups are consecutive ranks,
one per stage; with one stage the TP group is the whole world.
"""

from __future__ import annotations

import logging
from datetime import timedelta

import torch
import torch.distributed as dist

from shardserve import envs
from shardserve.distributed.pipeline import PipelineGroup
from shardserve.distributed.rank_layout import RankLayout
from shardserve.distributed.shm_allreduce import ShmAllReduce

logger = logging.getLogger(__name__)

STORE_CLIENT_SCHEME = "tcpstore://"  # "tcpstore://host:port": join a running TCPStore


class GroupCoordinator:
    """A tensor-parallel group: this rank's index and the collectives the layers need."""

    def __init__(
        self, rank: int = 0, world_size: int = 1, group: object | None = None,
        first_global_rank: int = 0,
    ) -> None:
        self.rank = rank  # within the group
        self.world_size = world_size
        self.group = group
        self.first_global_rank = first_global_rank
        self.shm: ShmAllReduce | None = None  # CPU ranks sharing a machine
        # Which path each collective took (world size > 1 only): a call too big for a slot
        # quietly goes to gloo, so tests and benchmarks read these to know what they measured.
        self.shm_calls = 0
        self.fallback_calls = 0

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return tensor
        if self.shm is not None and self.shm.all_reduce(tensor):
            self.shm_calls += 1
            return tensor
        self.fallback_calls += 1
        dist.all_reduce(tensor, group=self.group)
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's `tensor` along `dim`, in rank order."""
        if self.world_size == 1:
            return tensor
        tensor = tensor.contiguous()
        if self.shm is not None and (out := self.shm.all_gather(tensor, dim)) is not None:
            self.shm_calls += 1
            return out
        self.fallback_calls += 1
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor, group=self.group)
        return torch.cat(parts, dim=dim)

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier(group=self.group)


_TP_GROUP = GroupCoordinator()
_PP_GROUP = PipelineGroup()
# Context parallelism (RankLayout's pcp axis, and the dcp groups over TP x PCP): world size 1
# unless the layout has them, so code may call their collectives unconditionally.
_PCP_GROUP = GroupCoordinator()
_DCP_GROUP = GroupCoordinator()


def get_tp_group() -> GroupCoordinator:
    return _TP_GROUP


def get_pcp_group() -> GroupCoordinator:
    """This rank's prefill context parallel group: the same TP rank of every context shard."""
    return _PCP_GROUP


def get_dcp_group() -> GroupCoordinator:
    """This rank's decode context parallel group: the ranks that share one request's KV cache,
    each holding the positions it owns (model/context_parallel.py)."""
    return _DCP_GROUP


def get_pp_group() -> PipelineGroup:
    return _PP_GROUP


def init_distributed(
    rank: int,
    world_size: int,
    init_method: str,
    backend: str = "gloo",
    timeout_s: float = 600.0,
    layout: RankLayout | None = None,
    pp_slot_bytes: int = 16 << 20,
    pp_timeout_s: float = 300.0,
    nodes: list[int] | None = None,
) -> GroupCoordinator:
    """Join the default process group and build this rank's TP and PP groups.

    layout: the replica's ranks (default: TP over the whole world, one stage). pp_slot_bytes: the
    largest hand-off between stages that goes through shared memory (bigger ones: gloo);
    pp_timeout_s bounds a wait for a neighbour stage there. nodes: the machine of each rank
    (several machines): shared memory only joins ranks of one node — on a loopback test's two
    "nodes" it would work, and hide the path real nodes take.
    """
    global _TP_GROUP, _PP_GROUP, _PCP_GROUP, _DCP_GROUP
    layout = (layout or RankLayout(tp=world_size)).replica()
    if layout.world_size != world_size:
        raise ValueError(f"world size {world_size} is not the layout's {layout.world_size}")
    tp_size, pp_size = layout.tp, layout.pp
    if world_size > 1 and not dist.is_initialized():
        timeout = timedelta(seconds=timeout_s)
        if init_method.startswith(STORE_CLIENT_SCHEME):
            # A store that some process other than rank 0 serves (multi-node mp: the engine
            # core on node 0, wherever this replica's rank 0 runs): every rank is a client.
            host, port = init_method.removeprefix(STORE_CLIENT_SCHEME).rsplit(":", 1)
            store = dist.TCPStore(host, int(port), is_master=False, timeout=timeout)
            dist.init_process_group(backend=backend, store=store, rank=rank,
                                    world_size=world_size, timeout=timeout)
        else:
            dist.init_process_group(backend=backend, init_method=init_method, rank=rank,
                                    world_size=world_size, timeout=timeout)
    where = layout.coords(rank)
    tp_groups = layout.replica_groups("tp")
    tp_ranks = layout.group_of("tp", rank)
    _TP_GROUP = GroupCoordinator(where.tp, tp_size, _new_group(tp_groups, tp_ranks, world_size),
                                 first_global_rank=tp_ranks[0])
    _PP_GROUP = PipelineGroup(where.pp, tuple(layout.group_of("pp", rank)))
    _PCP_GROUP = _coordinator(layout, "pcp", rank)
    _DCP_GROUP = _coordinator(layout, "dcp", rank)
    nodes = nodes or [0] * world_size
    if world_size > 1 and backend == "gloo" and envs.shm_allreduce():
        # Every rank takes the same branches (each below is a collective over its group).
        for kind, coord in (("tp", _TP_GROUP), ("pcp", _PCP_GROUP), ("dcp", _DCP_GROUP)):
            groups = layout.replica_groups(kind)
            if coord.world_size > 1 and all(len({nodes[r] for r in g}) == 1 for g in groups):
                coord.shm = _attach_shm_allreduce(coord)
            elif coord.world_size > 1:
                logger.info("a %s group spans nodes: gloo collectives", kind.upper())
        if pp_size > 1 and len(set(nodes)) == 1:
            _PP_GROUP.attach_pipes(pp_slot_bytes, pp_timeout_s)
    return _TP_GROUP


def _coordinator(layout: RankLayout, kind: str, rank: int) -> GroupCoordinator:
    """The group of `kind` this rank is in (collective: every rank creates every group)."""
    groups = layout.replica_groups(kind)
    mine = layout.group_of(kind, rank)
    if len(mine) == 1:
        return GroupCoordinator()
    return GroupCoordinator(mine.index(rank), len(mine),
                            _new_group(groups, mine, layout.world_size),
                            first_global_rank=mine[0])


def _new_group(groups: list[list[int]], mine: list[int], world_size: int) -> object | None:
    """The torch.distributed group of this rank's `mine` among `groups` (the world when it is
    the whole world). Every rank must create every group, in the same order, even those it is
    not in."""
    if len(mine) == 1:
        return None
    if len(mine) == world_size:
        return dist.group.WORLD
    made = [dist.new_group(g) for g in groups]
    return made[groups.index(mine)]


def _attach_shm_allreduce(coord: GroupCoordinator) -> ShmAllReduce | None:
    """Map one segment on every rank of the group; use it only if every rank could (same
    machine). Collective over the group."""
    rank, world_size, group = coord.rank, coord.world_size, coord.group
    names = [ShmAllReduce.new_name() if rank == 0 else None]
    dist.broadcast_object_list(names, src=coord.first_global_rank, group=group)
    shm = None
    try:
        if rank == 0:
            shm = _create_shm(world_size, names[0])
    except OSError:
        shm = None
    dist.barrier(group=group)  # created before anyone attaches
    try:
        if rank != 0:
            shm = ShmAllReduce(rank, world_size, names[0], create=False)
    except OSError:
        shm = None
    ok = torch.tensor([1 if shm is not None else 0])
    dist.all_reduce(ok, group=group)  # gloo: every rank learns whether all ranks mapped it
    if rank == 0 and shm is not None:
        shm.unlink()  # every rank has mapped it (or given up): nothing left to leak
    if int(ok) != world_size and shm is not None:
        shm.close()
        shm = None
    return shm


def _create_shm(world_size: int, name: str) -> ShmAllReduce | None:
    """The full-size segment, or a smaller one where /dev/shm cannot hold it (rank 0 only)."""
    for buffer_bytes in (ShmAllReduce.BUFFER_BYTES, ShmAllReduce.MIN_BUFFER_BYTES):
        try:
            return ShmAllReduce(0, world_size, name, create=True, buffer_bytes=buffer_bytes)
        except OSError as e:
            logger.warning("shared-memory all-reduce: %d MiB buffers do not fit /dev/shm (%s)",
                           buffer_bytes >> 20, e)
    return None


def destroy_distributed() -> None:
    global _TP_GROUP, _PP_GROUP, _PCP_GROUP, _DCP_GROUP
    for coord in (_TP_GROUP, _PCP_GROUP, _DCP_GROUP):
        if coord.shm is not None:
            coord.shm.close()
    _PP_GROUP.close()
    if dist.is_initialized():
        dist.destroy_process_group()
    _TP_GROUP, _PCP_GROUP, _DCP_GROUP = GroupCoordinator(), GroupCoordinator(), GroupCoordinator()
    _PP_GROUP = PipelineGroup()
