"""Process groups for tensor parallelism.

Model layers call `get_tp_group()` and use only `.rank`, `.world_size`, `.all_reduce` and
`.all_gather`. At world size 1 (the default, before `init_distributed`) every collective is the
identity, so the same layer code runs unsharded in one process.
"""

from __future__ import annotations

import logging
from datetime import timedelta

import torch
import torch.distributed as dist

from shardserve import envs
from shardserve.distributed.shm_allreduce import ShmAllReduce

logger = logging.getLogger(__name__)


class GroupCoordinator:
    """A tensor-parallel group: this rank's index and the collectives the layers need."""

    def __init__(self, rank: int = 0, world_size: int = 1, group: object | None = None) -> None:
        self.rank = rank
        self.world_size = world_size
        self.group = group
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


def get_tp_group() -> GroupCoordinator:
    return _TP_GROUP


def init_distributed(
    rank: int,
    world_size: int,
    init_method: str,
    backend: str = "gloo",
    timeout_s: float = 600.0,
) -> GroupCoordinator:
    """Join the default process group and make it the tensor-parallel group.

    Only tensor parallelism is built so far, so the TP group is the whole world.
    """
    global _TP_GROUP
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group(
            backend=backend,
            init_method=init_method,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
        )
    _TP_GROUP = GroupCoordinator(rank, world_size, dist.group.WORLD if world_size > 1 else None)
    if world_size > 1 and backend == "gloo" and envs.shm_allreduce():
        _TP_GROUP.shm = _attach_shm_allreduce(rank, world_size)
    return _TP_GROUP


def _attach_shm_allreduce(rank: int, world_size: int) -> ShmAllReduce | None:
    """Map one segment on every rank; use it only if every rank could (same machine)."""
    names = [ShmAllReduce.new_name() if rank == 0 else None]
    dist.broadcast_object_list(names, src=0)
    shm = None
    try:
        if rank == 0:
            shm = _create_shm(world_size, names[0])
        dist.barrier()  # created before anyone attaches
        if rank != 0:
            shm = ShmAllReduce(rank, world_size, names[0], create=False)
    except OSError:
        shm = None
    ok = torch.tensor([1 if shm is not None else 0])
    dist.all_reduce(ok)  # gloo: every rank learns whether all ranks mapped it
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
    global _TP_GROUP
    if _TP_GROUP.shm is not None:
        _TP_GROUP.shm.close()
    if dist.is_initialized():
        dist.destroy_process_group()
    _TP_GROUP = GroupCoordinator()
