"""The paged KV cache's bookkeeping: a pool of fixed-size blocks and each request's block table.

Pure Python: the tensors live in the workers; this side only decides which block ids a request
owns. Invariant: a block id is either free or owned by exactly one request.
"""

from __future__ import annotations

from collections import deque


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._tables: dict[str, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, 0.0 to 1.0."""
        return 1.0 - len(self._free) / self.num_blocks

    def block_ids(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate(self, request_id: str, total_tokens: int) -> list[int] | None:
        """Grow the request's table to hold `total_tokens`; return the new block ids, or None
        (allocating nothing) when the pool has too few free blocks."""
        table = self._tables.setdefault(request_id, [])
        missing = self.blocks_needed(total_tokens) - len(table)
        if missing <= 0:
            return []
        if missing > len(self._free):
            return None
        new = [self._free.popleft() for _ in range(missing)]
        table.extend(new)
        return new

    def free(self, request_id: str) -> None:
        # Freed blocks go to the front so they are reused first (they are warm in cache).
        for block in reversed(self._tables.pop(request_id, [])):
            self._free.appendleft(block)
