"""The adapters of one rank: loaded from disk into a CPU cache (least recently used evicted,
pinned kept), and before each step placed into the model's `max_loras` slots.

    manager = LoRAManager(model, lora_config, model_dtype)   # gives the model its slots
    manager.add(LoRARequest("sql", 1, "/path"))               # load + check (LoRAError)
    manager.prepare([req_a, None, req_a], [5, 1, 1])          # per scheduled request, in order

Each rank loads the adapter itself, keeps only its own shard of it (its tensor-parallel slice
of the layers of its pipeline stage), so the cache holds what the slots take, ready to copy.
Every rank sees the same sequence of add/remove/pin/prepare calls (collective_rpc, one step's
scheduler output), so the caches and the slot assignment agree across ranks without talking.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from shardserve.config.lora import LoRAConfig
from shardserve.lora.peft_adapter import LoRAError, load_peft_adapter
from shardserve.lora.request import LoRARequest
from shardserve.model.llama import LlamaForCausalLM
from shardserve.model.lora import SubShard


@dataclass
class _Loaded:
    request: LoRARequest
    shards: dict[tuple[int, str], list[SubShard | None]]  # (layer, module path) -> per sub


class LoRAManager:
    """add/remove/pin/list the rank's adapters; prepare(...) sets up one step."""

    def __init__(self, model: LlamaForCausalLM, lora_config: LoRAConfig,
                 model_dtype: torch.dtype) -> None:
        if model.lora_batch is None:
            model.enable_lora(lora_config, lora_config.torch_dtype(model_dtype))
        assert model.lora_batch is not None
        self.model, self.config, self.batch = model, lora_config, model.lora_batch
        self.device = next(model.parameters()).device
        self._cache: OrderedDict[int, _Loaded] = OrderedDict()  # least recently used first
        self._pinned: set[int] = set()
        self._slots: list[int | None] = [None] * lora_config.max_loras  # adapter id per slot

    def add(self, req: LoRARequest) -> bool:
        """Load and check `req`'s adapter; False if it is loaded already (then it counts as
        just used). Raises LoRAError for an adapter that cannot be served (nothing evicted)."""
        if req.lora_int_id in self._cache:
            self._cache.move_to_end(req.lora_int_id)
            return False
        loaded = self._load(req)
        self._make_room(keep=set())
        self._cache[req.lora_int_id] = loaded
        return True

    def remove(self, lora_int_id: int) -> bool:
        """Forget the adapter (its slot becomes free); False if it was not loaded."""
        self._pinned.discard(lora_int_id)
        self._slots = [None if s == lora_int_id else s for s in self._slots]
        return self._cache.pop(lora_int_id, None) is not None

    def pin(self, lora_int_id: int) -> bool:
        """Keep the adapter loaded whatever max_cpu_loras evicts; False if it is not loaded
        (add it first)."""
        if lora_int_id not in self._cache:
            return False
        self._pinned.add(lora_int_id)
        return True

    def prepare(self, loras: Sequence[LoRARequest | None], num_tokens: Sequence[int]) -> None:
        """Set up the next forward: `loras[i]` is the adapter of the i-th scheduled request
        (None: the base model), `num_tokens[i]` its token count this step, in batch order."""
        if len(loras) != len(num_tokens):
            raise ValueError(f"{len(loras)} requests but {len(num_tokens)} token counts")
        distinct = {r.lora_int_id: r for r in loras if r is not None}
        if len(distinct) > self.config.max_loras:
            raise ValueError(f"{len(distinct)} distinct adapters in one step "
                             f"({sorted(distinct)}) but max_loras={self.config.max_loras}")
        if not distinct:
            self.batch.set(None)
            return
        for lora_id in distinct:
            if lora_id in self._cache:
                self._cache.move_to_end(lora_id)
        for lora_id, req in distinct.items():
            if lora_id not in self._cache:
                loaded = self._load(req)
                self._make_room(keep=set(distinct))
                self._cache[lora_id] = loaded
        slot_of = self._assign(list(distinct))
        slots: list[int] = []
        for req, n in zip(loras, num_tokens, strict=True):
            slots += [-1 if req is None else slot_of[req.lora_int_id]] * n
        self.batch.set(slots, self.device)

    def _load(self, req: LoRARequest) -> _Loaded:
        """This rank's shards of the adapter (only this stage's layers are read)."""
        layers = self.model.lora_layers
        adapter = load_peft_adapter(req.lora_path, self.model.arch, self.config.max_lora_rank,
                                    layers=layers.keys())
        shards = {}
        for layer, modules in layers.items():
            for path, weights in modules.items():
                subs = [adapter.modules.get((layer, name)) for name in weights.names]
                if any(m is not None for m in subs):
                    shards[(layer, path)] = weights.shard(
                        [None if m is None else (m.a, m.b, m.scaling) for m in subs])
        return _Loaded(req, shards)

    def _make_room(self, keep: set[int]) -> None:
        """Evict least recently used adapters (never pinned ones, nor `keep`) until one more
        fits in max_cpu_loras."""
        while len(self._cache) >= self.config.cpu_loras:
            victim = next((i for i in self._cache if i not in self._pinned and i not in keep),
                          None)
            if victim is None:
                raise LoRAError(
                    f"max_cpu_loras={self.config.cpu_loras} adapters are loaded and all are "
                    f"pinned or in this step ({sorted(self._cache)}): raise max_cpu_loras or "
                    f"remove one")
            self.remove(victim)

    def _assign(self, ids: list[int]) -> dict[int, int]:
        """A slot per adapter of the step: where it already sits, else a slot not used by
        this step (its weights written there)."""
        slot_of = {i: s for s, i in enumerate(self._slots) if i in ids}
        free = [s for s, i in enumerate(self._slots) if i is None or i not in ids]
        for lora_id in ids:
            if lora_id in slot_of:
                continue
            slot = free.pop(0)
            self._write(slot, self._cache[lora_id])
            self._slots[slot] = lora_id
            slot_of[lora_id] = slot
        return slot_of

    def _write(self, slot: int, loaded: _Loaded) -> None:
        for layer, modules in self.model.lora_layers.items():
            for path, weights in modules.items():
                shards = loaded.shards.get((layer, path)) or [None] * len(weights.names)
                weights.write(slot, shards)

    def slot_of(self, lora_int_id: int) -> int | None:
        """The slot holding the adapter now (None: in none)."""
        return self._slots.index(lora_int_id) if lora_int_id in self._slots else None

    def list(self) -> list[int]:
        """The ids of the adapters loaded on this rank, sorted."""
        return sorted(self._cache)

    def held(self) -> list[tuple[LoRARequest, bool]]:
        """Each loaded adapter's request and whether it is pinned, least recently used first
        (what a manager for a reloaded model needs to hold the same)."""
        return [(loaded.request, lora_id in self._pinned)
                for lora_id, loaded in self._cache.items()]
