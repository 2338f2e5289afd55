"""The paged KV cache's bookkeeping: a pool of fixed-size blocks, each request's block table, and
(prefix caching) the full blocks' contents by hash.

Pure Python: the tensors live in the workers; this side only decides which block ids a request
holds. Without prefix caching a block is free or owned by exactly one request. With it:

    hash(block i) = sha256(hash(block i-1) || token ids of block i)      (full blocks only)
    hash(block -1) = the root: a constant for the base model, another per LoRA adapter (its
                     id and path: an id removed and given to another adapter starts afresh)

The same tokens through another adapter have other K/V (the adapter changes k_proj and v_proj,
and every layer's input), so a request shares blocks only with requests of its own adapter.

A full block is registered under its hash once its tokens are known and its KV computed (or
scheduled: steps run in order, so a later step reading it finds it written). A request's leading
full blocks whose hashes are registered are shared (reference-counted) instead of recomputed; the
last prompt token is always recomputed, so a step has a token to sample from. A block whose last
holder lets go joins the free queue's tail still registered: it is reused only when it reaches
the head (least recently freed first), and only then does it lose its hash. A request's blocks
are released last-first, so a prefix outlives its tails. Blocks never registered (partial, or
caching off) go to the head: they hold nothing worth keeping.

    free queue:  head [unregistered ..., oldest registered, ..., newest registered] tail
                  ▲ allocation takes from here (evicting the block's hash, if any)
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

_ROOT = b"shardserve-prefix-root"


def _root(lora_key: str) -> bytes:
    """The chain's start: the base model's root (key ""), or the adapter's own."""
    return _ROOT if not lora_key else _ROOT + b"/lora/" + lora_key.encode()


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up (requests that may use the cache)
    hits: int = 0  # of those, tokens found cached


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int,
                 enable_prefix_caching: bool = False) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._tables: dict[str, list[int]] = {}
        self._ref = [0] * num_blocks
        self._hash: list[bytes | None] = [None] * num_blocks
        self._by_hash: dict[bytes, int] = {}
        self._chain: dict[str, list[bytes]] = {}  # request → hashes of its leading full blocks
        self.stats = PrefixCacheStats()

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests, 0.0 to 1.0 (cached free blocks are free)."""
        return 1.0 - len(self._free) / self.num_blocks

    def block_ids(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix caching ----
    def cached_prefix(self, tokens: Sequence[int], max_tokens: int,
                      lora_key: str = "") -> list[int]:
        """The registered blocks holding the leading full blocks of `tokens` (computed with
        the adapter `lora_key` names, "" for the base model: Request.lora_key), at most
        max_tokens // block_size of them."""
        if not self.enable_prefix_caching:
            return []
        hits, parent = [], _root(lora_key)
        for i in range(max_tokens // self.block_size):
            parent = self._digest(parent, tokens, i)
            block = self._by_hash.get(parent)
            if block is None:
                break
            hits.append(block)
        return hits

    def count_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """A request admitted after a lookup: its prompt tokens and those found cached."""
        self.stats.queries += num_tokens
        self.stats.hits += num_hit_tokens

    def num_registered(self, request_id: str) -> int:
        """Leading full blocks of the request already hashed (registered or shared)."""
        return len(self._chain.get(request_id, ()))

    def register_full_blocks(self, request_id: str, tokens: Sequence[int],
                             num_computed: int, lora_key: str = "") -> None:
        """Register the request's full blocks within its first `num_computed` tokens (whose
        ids are all known, computed with adapter `lora_key`) that are not registered yet."""
        if not self.enable_prefix_caching:
            return
        table, chain = self._tables.get(request_id, []), self._chain.setdefault(request_id, [])
        full = min(num_computed // self.block_size, len(table))
        for i in range(len(chain), full):
            digest = self._digest(chain[-1] if chain else _root(lora_key), tokens, i)
            chain.append(digest)
            block = table[i]
            if self._hash[block] is None and digest not in self._by_hash:
                self._hash[block] = digest
                self._by_hash[digest] = block

    def _digest(self, parent: bytes, tokens: Sequence[int], index: int) -> bytes:
        start = index * self.block_size
        ids = np.asarray(tokens[start:start + self.block_size], dtype=np.int64)
        return hashlib.sha256(parent + ids.tobytes()).digest()

    # ---- allocation ----
    def allocate(self, request_id: str, total_tokens: int,
                 prefix: Sequence[int] = ()) -> list[int] | None:
        """Grow the request's table to hold `total_tokens`, starting a new table with the
        cached `prefix` blocks (from cached_prefix); return the newly allocated block ids, or
        None (changing nothing) when the pool has too few free blocks."""
        table = self._tables.get(request_id)
        if table is None:
            table = list(prefix)
        missing = self.blocks_needed(total_tokens) - len(table)
        reviving = sum(1 for b in set(prefix) if self._ref[b] == 0) if request_id not in \
            self._tables else 0
        if max(missing, 0) + reviving > len(self._free):
            return None
        if request_id not in self._tables:
            for block in prefix:
                self._hold(block)
            self._tables[request_id] = table
        new = [self._take_free() for _ in range(max(missing, 0))]
        for block in new:
            self._ref[block] = 1
        table.extend(new)
        return new

    def _hold(self, block: int) -> None:
        if self._ref[block] == 0:
            del self._free[block]
        self._ref[block] += 1

    def _take_free(self) -> int:
        block, _ = self._free.popitem(last=False)
        digest = self._hash[block]
        if digest is not None:  # evicted: its contents are about to be overwritten
            self._hash[block] = None
            del self._by_hash[digest]
        return block

    def free(self, request_id: str) -> None:
        self._chain.pop(request_id, None)
        for block in reversed(self._tables.pop(request_id, [])):
            self._ref[block] -= 1
            if self._ref[block] > 0:
                continue
            self._free[block] = None
            if self._hash[block] is None:  # nothing to keep: reused first
                self._free.move_to_end(block, last=False)
