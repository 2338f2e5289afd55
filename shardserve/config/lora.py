"""LoRA serving options (`LLM(enable_lora=True, ...)`, `--enable-lora`), as vLLM names them.

max_loras adapters may be in one step (each takes a slot of the per-layer stacked weights);
max_cpu_loras stay loaded on every rank (least recently used evicted, pinned ones kept); an
adapter's rank may not exceed max_lora_rank (the slots are that wide)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardserve.config.checks import check

LORA_DTYPES = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16,
               "float16": torch.float16}


@dataclass(frozen=True)
class LoRAConfig:
    max_loras: int = 1
    """Most distinct adapters in one step (vLLM's default 1); others wait for a later step."""
    max_lora_rank: int = 16
    """Largest adapter rank accepted; the slots are this wide."""
    max_cpu_loras: int | None = None
    """Adapters kept loaded on each rank (None: max_loras); least recently used evicted first,
    pinned ones never. Must be >= max_loras."""
    lora_dtype: str = "auto"
    """Element type of the adapters' weights: auto (the model's dtype), float32, bfloat16."""

    def __post_init__(self) -> None:
        check(isinstance(self.max_loras, int) and self.max_loras >= 1,
              f"max_loras={self.max_loras!r} must be an int >= 1")
        check(isinstance(self.max_lora_rank, int) and self.max_lora_rank >= 1,
              f"max_lora_rank={self.max_lora_rank!r} must be an int >= 1")
        check(self.max_cpu_loras is None or (isinstance(self.max_cpu_loras, int) and
                                             self.max_cpu_loras >= self.max_loras),
              f"max_cpu_loras={self.max_cpu_loras!r} must be >= max_loras={self.max_loras}")
        check(self.lora_dtype in LORA_DTYPES,
              f"lora_dtype={self.lora_dtype!r} is not supported; choose one of: "
              f"{', '.join(LORA_DTYPES)}")

    @property
    def cpu_loras(self) -> int:
        """max_cpu_loras resolved (None means max_loras)."""
        return self.max_cpu_loras or self.max_loras

    def torch_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        return LORA_DTYPES[self.lora_dtype] or model_dtype
