"""WorkerLoRAs: a rank's side of the engine's adapter calls (Worker.add_lora, remove_lora,
pin_lora, list_loras) and of each step's adapters, over the model's LoRAManager
(worker/lora_manager.py, which loads, validates, caches and slots the adapters).

The manager belongs to one loaded model (its slots are that model's tensors). When the model is
freed (sleep level 2) the manager goes with it, so the weights are really freed; the adapters it
held, pinned ones pinned, are loaded again into the next model's manager (wake_up), so the
engine's view of what is loaded stays true. An adapter the manager evicted meanwhile is not
brought back: a step that needs it loads it from its lora_path, as after any eviction.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from shardserve.config.lora import LoRAConfig
from shardserve.lora.request import LoRARequest
from shardserve.model.llama import LlamaForCausalLM

if TYPE_CHECKING:
    from shardserve.worker.lora_manager import LoRAManager


class WorkerLoRAs:
    def __init__(self, lora_config: LoRAConfig, model_dtype: torch.dtype) -> None:
        self.lora_config = lora_config
        self.model_dtype = model_dtype
        self.manager: LoRAManager | None = None
        # What the last manager held (request, pinned) when its model was freed.
        self._kept: list[tuple[LoRARequest, bool]] = []

    def attach(self, model: LlamaForCausalLM) -> None:
        """A manager for the model just loaded, holding again what the last one held."""
        from shardserve.worker.lora_manager import LoRAManager  # only with enable_lora

        self.manager = LoRAManager(model, self.lora_config, self.model_dtype)
        for lora_request, pinned in self._kept:
            self.manager.add(lora_request)
            if pinned:
                self.manager.pin(lora_request.lora_int_id)
        self._kept = []

    def detach(self) -> None:
        """The model is freed: drop its manager, remembering what it held."""
        if self.manager is not None:
            self._kept = self.manager.held()
        self.manager = None

    def add(self, lora_request: LoRARequest) -> bool:
        return self._manager().add(lora_request)

    def remove(self, lora_int_id: int) -> bool:
        return self._manager().remove(lora_int_id)

    def pin(self, lora_int_id: int) -> bool:
        return self._manager().pin(lora_int_id)

    def list(self) -> list[int]:
        return self._manager().list()

    def prepare(self, loras: Sequence[LoRARequest | None], num_tokens: Sequence[int]) -> None:
        """Before a step's forward pass: each scheduled request's adapter (None: the base
        model) and its token count, in batch order (the manager loads what is missing and
        sets the per-token slots)."""
        self._manager().prepare(loras, num_tokens)

    def _manager(self) -> LoRAManager:
        if self.manager is None:
            raise RuntimeError("the model is not loaded (call load_model, or wake_up after "
                               "sleep): its adapters cannot be reached")
        return self.manager
