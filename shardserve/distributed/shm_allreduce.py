"""All-reduce and all-gather through shared memory for CPU ranks on one machine.

gloo's TCP all-reduce costs about a millisecond per call on a small machine, and a decode step
makes two per layer (plus one all-gather of the logits, ~6 ms at 32 rows). Ranks that share a
machine can instead exchange through one shared segment:

    [ counter rank 0 | ... | counter rank W-1 ]  one int64 each, 64 bytes apart
    [ buffer 0: slot rank 0 | ... | slot rank W-1 ]  slot_bytes each
    [ buffer 1: slot rank 0 | ... | slot rank W-1 ]

Call k (1-based): every rank copies its tensor into its slot of buffer k % 2, then publishes k in
its counter, waits until every counter reaches k, and sums the slots in rank order (so every rank
gets bit-identical results), or for an all-gather concatenates them. Two buffers make a slot safe
to overwrite: a rank can start call k+2 only after every rank has published k+1, i.e. has
finished reading call k.
The segment is unlinked as soon as every rank has mapped it, so nothing can leak.

Sizing: one buffer (all slots together) holds BUFFER_BYTES = 24 MiB, so a slot is 24 MiB / W.
The largest collective the model makes is the all-gather of a decode step's logits: each rank
holds vocab / W columns, so what one buffer must hold is rows x vocab x element size whatever
W is, and 24 MiB is max_num_seqs (128, the default) rows of the default model's 49152-entry
vocab in float32 (bfloat16: 256 rows). The all-reduces (tokens x hidden, at most
max_num_batched_tokens=2048 x 576 x 4 bytes = 4.5 MiB per rank) fit with room to spare. Larger
calls (bigger vocabularies, wider batches) go to gloo; `GroupCoordinator` counts which path each
call took. The segment is 2 x 24 MiB; where /dev/shm cannot hold that (a container's 64 MB
default, shared with the executor's queues), the creator falls back to MIN_BUFFER_BYTES and the
other ranks read the size from the segment itself.
"""

from __future__ import annotations

import errno
import mmap
import os
import secrets
import time

import numpy as np
import torch

_COUNTER_STRIDE = 8  # int64s between counters: one cache line each
_TIMEOUT_S = 300.0


def map_segment(path: str, create_size: int | None) -> mmap.mmap:
    """Map the /dev/shm segment `path`: created with `create_size` bytes (all pages reserved
    now), or, with None, an existing one at its own size. A failed create leaves no file."""
    create = create_size is not None
    fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
    try:
        if create_size is not None:
            os.ftruncate(fd, create_size)
            _reserve_pages(fd, create_size)
        return mmap.mmap(fd, create_size or os.fstat(fd).st_size)
    except BaseException:
        if create:
            os.unlink(path)
        raise
    finally:
        os.close(fd)


def unmap_segment(mapping: mmap.mmap) -> None:
    """Close a mapping once its owner dropped its views; one still alive elsewhere keeps it
    (it goes with the process)."""
    try:
        mapping.close()
    except BufferError:
        pass


def _reserve_pages(fd: int, size: int) -> None:
    """Allocate the pages now: tmpfs allocates on first touch, and running out then is a SIGBUS
    mid-step; here it is an OSError, and the caller falls back to gloo."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise


class ShmAllReduce:
    BUFFER_BYTES = 24 << 20  # see "Sizing" above
    MIN_BUFFER_BYTES = 8 << 20  # where /dev/shm is short

    def __init__(
        self, rank: int, world_size: int, name: str, create: bool, buffer_bytes: int | None = None
    ) -> None:
        """Create (rank 0) or map the segment `name`. Only the creator chooses `buffer_bytes`;
        an attaching rank takes the size the creator chose from the segment."""
        header = world_size * _COUNTER_STRIDE * 8
        path = os.path.join("/dev/shm", name)
        size = None
        if create:
            slot_bytes = self.slot_bytes_for(world_size, buffer_bytes or self.BUFFER_BYTES)
            size = header + 2 * world_size * slot_bytes
        self._map = map_segment(path, size)
        slot_bytes = (len(self._map) - header) // (2 * world_size)
        self.rank, self.world_size, self.slot_bytes = rank, world_size, slot_bytes
        self.path = path
        self._counters = np.frombuffer(self._map, dtype=np.int64, count=header // 8)
        raw = torch.frombuffer(
            self._map, dtype=torch.uint8, offset=header, count=2 * world_size * slot_bytes
        )
        self._slots = raw.view(2, world_size, slot_bytes)
        self._seq = 0

    @staticmethod
    def slot_bytes_for(world_size: int, buffer_bytes: int) -> int:
        """One rank's slot: its share of a buffer, rounded up to whole cache lines."""
        return -(-buffer_bytes // world_size // 64) * 64

    @staticmethod
    def new_name() -> str:
        return f"shardserve-ar-{os.getpid()}-{secrets.token_hex(4)}"

    def unlink(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def all_reduce(self, tensor: torch.Tensor) -> bool:
        """Sum `tensor` over the ranks in place; False (untouched) when it does not fit."""
        view = self._exchange(tensor)
        if view is None:
            return False
        tensor.copy_(view[0].view(tensor.dtype).view(tensor.shape))
        for r in range(1, self.world_size):  # rank order: every rank gets the same bits
            tensor.add_(view[r].view(tensor.dtype).view(tensor.shape))
        return True

    def all_gather(self, tensor: torch.Tensor, dim: int) -> torch.Tensor | None:
        """Every rank's `tensor` concatenated along `dim` in rank order; None when it does not
        fit. (gloo's all_gather of a batch's logits costs ~6 ms at 32 rows; this ~1 ms.)"""
        view = self._exchange(tensor)
        if view is None:
            return None
        parts = [view[r].view(tensor.dtype).view(tensor.shape) for r in range(self.world_size)]
        return torch.cat(parts, dim=dim)  # copies out before the slots can be reused

    def _exchange(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """Publish `tensor` in this rank's slot and wait for everyone's: [world, nbytes] bytes.

        The view stays valid until this rank's next call (see the module docstring)."""
        nbytes = tensor.numel() * tensor.element_size()
        if tensor.device.type != "cpu" or not tensor.is_contiguous() or nbytes > self.slot_bytes:
            return None
        self._seq += 1
        slots = self._slots[self._seq % 2]
        slots[self.rank, :nbytes].copy_(tensor.view(-1).view(torch.uint8))
        self._counters[self.rank * _COUNTER_STRIDE] = self._seq  # publish after the copy (TSO)
        self._wait_all(self._seq)
        return slots[:, :nbytes]

    def _wait_all(self, seq: int) -> None:
        counters = self._counters[::_COUNTER_STRIDE][: self.world_size]
        if counters.min() >= seq:
            return
        deadline = time.monotonic() + _TIMEOUT_S
        polls = 0
        while counters.min() < seq:
            polls += 1
            # Yield the core: on a small machine the rank we wait for may need it.
            os.sched_yield()
            if polls % 4096 == 0 and time.monotonic() > deadline:
                late = [r for r in range(self.world_size) if counters[r] < seq]
                raise TimeoutError(
                    f"shared-memory all-reduce: ranks {late} did not arrive "
                    f"within {_TIMEOUT_S:.0f} s"
                )

    def close(self) -> None:
        self._slots = None  # type: ignore[assignment]
        self._counters = None  # type: ignore[assignment]
        unmap_segment(self._map)
