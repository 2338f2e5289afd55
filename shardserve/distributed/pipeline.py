"""The pipeline-parallel group of one rank: its stage, and the hand-off of hidden states.

A rank's pipeline group (RankLayout.pp_groups: the ranks at its place in every stage, in
stage order) names its neighbours: stage s's TP rank t hands its (hidden, residual) pair to
stage s+1's TP rank t (after a stage's last all-reduce every TP
rank of it holds the same full tensors). Ranks of one machine use a `ShmPipe` per neighbour;
elsewhere, or for a message bigger than a slot, torch.distributed send/recv (gloo or NCCL).
Sends of stage s and receives of stage s+1 happen in the same (step) order on both sides.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist

from shardserve.distributed.shm_pipe import ShmPipe

logger = logging.getLogger(__name__)


class PipelineGroup:
    """Stage `stage` of the pipeline `peers` (the group's ranks in stage order);
    `prev_rank`/`next_rank` are ranks of the world (None at the ends)."""

    def __init__(self, stage: int = 0, peers: tuple[int, ...] = (0,)):
        self.stage, self.num_stages = stage, len(peers)
        self.prev_rank = peers[stage - 1] if stage > 0 else None
        self.next_rank = peers[stage + 1] if stage < len(peers) - 1 else None
        self.send_pipe: ShmPipe | None = None
        self.recv_pipe: ShmPipe | None = None
        # Which path each hand-off took, for tests and benchmarks (as GroupCoordinator's).
        self.shm_calls = 0
        self.fallback_calls = 0

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1

    def send(self, tensors: list[torch.Tensor]) -> None:
        """Hand `tensors` to the next stage (returns once they are copied out of ours)."""
        assert self.next_rank is not None, "the last stage has no next stage"
        if self.send_pipe is not None and tensors[0].device.type == "cpu":
            if self.send_pipe.send(tensors):
                self.shm_calls += 1
                return
        self.fallback_calls += 1
        for t in tensors:
            dist.send(t.contiguous(), dst=self.next_rank)

    def recv(self, shapes: list[tuple[int, ...]], dtype: torch.dtype,
             device: torch.device) -> list[torch.Tensor]:
        """The previous stage's next message: tensors of `shapes` and `dtype` on `device`."""
        assert self.prev_rank is not None, "the first stage has no previous stage"
        if self.recv_pipe is not None and device.type == "cpu":
            got = self.recv_pipe.recv(shapes, dtype)
            if got is not None:
                self.shm_calls += 1
                return got
        self.fallback_calls += 1
        out = [torch.empty(s, dtype=dtype, device=device) for s in shapes]
        for t in out:
            dist.recv(t, src=self.prev_rank)
        return out

    def attach_pipes(self, slot_bytes: int, timeout_s: float) -> None:
        """Map a ShmPipe to each neighbour, all ranks together (a collective over the world);
        if any rank fails to, every rank keeps to torch.distributed."""
        created: ShmPipe | None = None
        try:
            if self.next_rank is not None:
                created = ShmPipe(ShmPipe.new_name(), True, slot_bytes, timeout_s)
        except OSError as e:
            logger.warning("pipeline hand-off: no shared-memory pipe (%s); using gloo", e)
        # Every rank learns its neighbour's pipe name; the gather also orders every create
        # before any map.
        names: list[str | None] = [None] * dist.get_world_size()
        dist.all_gather_object(names, os.path.basename(created.path) if created else None)
        try:
            if self.prev_rank is not None:
                name = names[self.prev_rank]
                if name is not None:
                    self.recv_pipe = ShmPipe(name, False, timeout_s=timeout_s)
        except OSError as e:
            logger.warning("pipeline hand-off: cannot map the pipe (%s); using gloo", e)
        ok = torch.tensor([0 if (self.next_rank is not None and created is None)
                           or (self.prev_rank is not None and self.recv_pipe is None) else 1])
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        self.send_pipe = created
        if created is not None:
            created.unlink()  # the receiver mapped it (or gave up): nothing left to leak
        if not int(ok):
            self.close()

    def close(self) -> None:
        for pipe in (self.send_pipe, self.recv_pipe):
            if pipe is not None:
                pipe.close()
        self.send_pipe = self.recv_pipe = None
