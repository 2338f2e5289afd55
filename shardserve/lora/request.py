"""LoRARequest: the adapter a request is served by, as vLLM spells it
(`from vllm.lora.request import LoRARequest`; here `shardserve.lora.request`).

    LoRARequest("sql", 1, "/path/to/adapter")     # lora_name, lora_int_id, lora_path

`lora_path` is a folder as `peft` saves it (adapter_config.json + adapter_model.safetensors).
`lora_int_id` is the adapter's identity in the engine (>= 1; 0 stands for the base model in the
per-token slot arrays): two requests with the same id share one loaded copy, and the prefix cache
keys blocks by it. It crosses process boundaries inside NewRequestData (pickled: plain fields).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None
    """The model the adapter was trained on (the server's `--lora-modules` JSON form); used for
    `/v1/models`' `parent` only."""

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name={self.lora_name!r} must be a non-empty string")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or \
                self.lora_int_id < 1:
            raise ValueError(f"lora_int_id={self.lora_int_id!r} must be an int >= 1 "
                             f"(0 is the base model)")
        if not isinstance(self.lora_path, str):
            raise ValueError(f"lora_path={self.lora_path!r} must be a string (a folder)")

    # vLLM's accessor names.
    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path
