"""A one-way shared-memory pipe for tensors between two CPU ranks of one machine (pipeline
stages hand their hidden states to the next stage through it).

gloo's send/recv costs a TCP round trip and, worse, a send may wait for the receiver, which
would stall stage k while stage k+1 still works on the previous micro-batch. The pipe has N
slots, so a sender runs up to N messages ahead of its receiver:

    [ written[0] | written[1] | ... | written[N-1] | read ]   int64 counters, 64 bytes apart
    [ slot 0 ][ slot 1 ] ... [ slot N-1 ]                      slot_bytes each

Message k (1-based) goes to slot k % N. The sender waits until `read >= k - N` (the slot's
previous message has been copied out), copies the tensors in back to back, then publishes
`written[k % N] = k`. The receiver waits until `written[k % N] == k`, copies out, then publishes
`read = k`. Each side wakes the other through a futex on the counter it just wrote, so a
waiting rank sleeps in the kernel instead of taking a core from the rank it waits for.
Both sides know every message's shapes and dtype (from the step's token count), so nothing but
the payload crosses. A message larger than a slot is refused (`send` returns False) and the
caller sends it another way; both sides make the same size test, so they stay in order.

The sender creates the segment; it is unlinked once the receiver has mapped it.
"""

from __future__ import annotations

import os
import secrets
import time

import numpy as np
import torch

from shardserve import envs
from shardserve.distributed.shm_allreduce import map_segment, unmap_segment
from shardserve.ipc.segments import unlink_segment
from shardserve.ipc.wakeup import futex_wait, futex_wake, poll_window_s

_STRIDE = 8  # int64s between counters: one cache line each
_SLEEP_SLICE_S = 0.05  # longest futex sleep before re-checking the deadline


class ShmPipe:
    NUM_SLOTS = 4

    def __init__(
        self, name: str, create: bool, slot_bytes: int = 0, timeout_s: float = 300.0
    ) -> None:
        """Create (the sender, choosing `slot_bytes`) or map (the receiver) segment `name`."""
        n = self.NUM_SLOTS
        header = (n + 1) * _STRIDE * 8
        path = os.path.join("/dev/shm", name)
        size = header + n * (-(-slot_bytes // 64) * 64) if create else None
        self._map = map_segment(path, size)
        slot_bytes = (len(self._map) - header) // n
        self.path, self.slot_bytes, self.timeout_s = path, slot_bytes, timeout_s
        self._counters = np.frombuffer(self._map, dtype=np.int64, count=header // 8)
        self._base = self._counters.ctypes.data
        raw = torch.frombuffer(self._map, dtype=torch.uint8, offset=header, count=n * slot_bytes)
        self._slots = raw.view(n, slot_bytes)
        self._seq = 0
        self._spin_s = poll_window_s(envs.ipc_spin_us())

    @staticmethod
    def new_name() -> str:
        """shardserve-pp-<creator pid>-<random>: the form ipc/segments.py reaps by pid."""
        return f"shardserve-pp-{os.getpid()}-{secrets.token_hex(4)}"

    def unlink(self) -> None:
        unlink_segment(os.path.basename(self.path))

    def fits(self, nbytes: int) -> bool:
        return nbytes <= self.slot_bytes

    def send(self, tensors: list[torch.Tensor]) -> bool:
        """Copy `tensors` (CPU) into the next slot; False (nothing sent) if they do not fit."""
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        if not self.fits(nbytes):
            return False
        seq = self._seq + 1
        self._wait(self.NUM_SLOTS, seq - self.NUM_SLOTS, "the next stage to free a slot")
        slot, offset = self._slots[seq % self.NUM_SLOTS], 0
        for t in tensors:
            size = t.numel() * t.element_size()
            slot[offset : offset + size].copy_(t.contiguous().view(-1).view(torch.uint8))
            offset += size
        self._publish(seq % self.NUM_SLOTS, seq)
        self._seq = seq
        return True

    def recv(self, shapes: list[tuple[int, ...]], dtype: torch.dtype) -> list[torch.Tensor] | None:
        """The next message as new tensors of `shapes`; None if they would not fit a slot (the
        sender then used another path)."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        sizes = [int(np.prod(s)) * itemsize for s in shapes]
        if not self.fits(sum(sizes)):
            return None
        seq = self._seq + 1
        self._wait(seq % self.NUM_SLOTS, seq, "the previous stage's hidden states")
        slot, offset, out = self._slots[seq % self.NUM_SLOTS], 0, []
        for shape, size in zip(shapes, sizes, strict=True):
            t = torch.empty(shape, dtype=dtype)
            t.view(-1).view(torch.uint8).copy_(slot[offset : offset + size])
            out.append(t)
            offset += size
        self._publish(self.NUM_SLOTS, seq)  # the slot may be reused from now on
        self._seq = seq
        return out

    def _publish(self, index: int, value: int) -> None:
        self._counters[index * _STRIDE] = value  # after the copy (x86 stores are ordered)
        futex_wake(self._base + index * _STRIDE * 8)

    def _wait(self, index: int, target: int, what: str) -> None:
        """Until counter `index` reaches `target`: poll (yielding), then sleep on its futex."""
        counter = self._counters[index * _STRIDE : index * _STRIDE + 1]
        if counter[0] >= target:
            return
        start = time.monotonic()
        spin_end, deadline = start + self._spin_s, start + self.timeout_s
        while (seen := int(counter[0])) < target:
            now = time.monotonic()
            if now < spin_end:
                os.sched_yield()
                continue
            if now >= deadline:
                raise TimeoutError(
                    f"pipeline stage hand-off: waited {now - start:.0f} s for {what} "
                    f"(parallel_config.execute_timeout_s bounds it)"
                )
            # Low 32 bits: the futex compares the word the kernel sees (little-endian int64).
            futex_wait(self._base + index * _STRIDE * 8, seen & 0xFFFFFFFF,
                       min(_SLEEP_SLICE_S, deadline - now))

    def close(self) -> None:
        self._slots = None  # type: ignore[assignment]
        self._counters = None  # type: ignore[assignment]
        unmap_segment(self._map)
