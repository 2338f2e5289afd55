"""What the engine runs: the device, the model's files and architecture, dtypes.

Plain data: `ModelConfig` holds the resolved paths, architecture and quantization as fields.
Resolving them (finding the default model, reading the files, choosing the quantized path) is
the construction path's job (engine/config_builder.py), so this module reads no files.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from shardserve import envs
from shardserve.config.checks import check
from shardserve.config.model_arch import ModelArch
from shardserve.config.pooler import resolve_runner

if TYPE_CHECKING:
    from shardserve.pooling_params import PoolerConfig

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}
QUANTIZATIONS = ("auto", "gguf", "int8", "none")


@functools.cache
def cpu_has_native_bf16() -> bool:
    """True where the CPU computes bfloat16 natively (AVX512-BF16 or AMX); else fp32 is faster.
    False where SHARDSERVE_ISA holds the kernels to a level without it (avx2, portable): dtype
    auto then picks what a CPU of that level would."""
    if envs.isa() != "native":
        return False
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_dtype(dtype: str | torch.dtype, device: str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if device == "cuda" or cpu_has_native_bf16():
            return torch.bfloat16
        return torch.float32
    check(
        dtype in _DTYPES,
        f"dtype={dtype!r} is not supported; choose one of: auto, {', '.join(_DTYPES)}",
    )
    return _DTYPES[dtype]


@dataclass(frozen=True)
class DeviceConfig:
    device: str = "auto"
    """'cpu', 'cuda' or 'auto' (cuda when available)."""

    def __post_init__(self) -> None:
        check(
            self.device in ("auto", "cpu", "cuda"),
            f"device={self.device!r} is not supported; choose auto, cpu or cuda",
        )
        if self.device == "auto":
            object.__setattr__(self, "device", "cuda" if torch.cuda.is_available() else "cpu")
        if self.device == "cuda":
            check(torch.cuda.is_available(), "device='cuda' but no CUDA device is visible")


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    path: Path
    """The resolved model folder or .gguf file."""
    arch: ModelArch
    """The model's architecture, read from its files."""
    tokenizer_path: Path | None = None
    """The resolved tokenizer folder or .gguf file; None: the model's own (set from path)."""
    model: str | None = None
    """What the user asked for: HF model folder or .gguf file; None selects the default model
    (SmolLM2-135M-Instruct)."""
    tokenizer: str | None = None
    """Tokenizer folder or .gguf file as asked; defaults to the model's own."""
    dtype: str = "auto"
    """auto (bfloat16 where the hardware computes it natively, else float32), float32,
    bfloat16 or float16."""
    max_model_len: int | None = None
    """Longest sequence (prompt + output); defaults to the model's max positions."""
    seed: int = 0
    """Seed of the random source for requests without their own seed."""
    trust_remote_code: bool = False
    """Let the tokenizer run code from the model folder (transformers' auto_map)."""
    tokenizer_mode: str = "auto"
    """auto or hf: the model's fast (tokenizer.json) tokenizer (vLLM's slow, mistral and custom
    modes are refused)."""
    enforce_eager: bool = False
    """vLLM's switch off CUDA graphs: shardserve runs eagerly always, so it changes nothing."""
    enable_sleep_mode: bool | None = None
    """vLLM's switch for sleep(): False refuses it (vLLM's default); True or unset allows it
    (shardserve needs no preparation for it)."""
    quantization: str = "auto"
    """gguf: compute with a GGUF file's quantized blocks as stored (Q4_0, Q4_1, Q8_0, Q4_K,
    Q5_K, Q6_K; other types are dequantized); int8: quantize the decoder's linear weights per
    output channel at load; none: dequantize everything to dtype. auto: gguf for a quantized
    GGUF file when dtype is auto, else none. CPU only. The construction path resolves auto."""
    runner: str = "generate"
    """generate (sample tokens) or pooling (one embedding a prompt: LLM.embed,
    /v1/embeddings); auto: generate, or pooling with convert=embed."""
    convert: str = "auto"
    """With runner=pooling: embed (auto means it) pools the causal LM's final hidden states."""
    pooler_config: PoolerConfig | dict | str | None = None
    """With runner=pooling: pooling_type (LAST, MEAN or CLS; default LAST) and normalize
    (default true), as a JSON object on the command line."""
    override_pooler_config: PoolerConfig | dict | str | None = None
    """vLLM's older name for pooler_config."""
    device: str = "cpu"

    def __post_init__(self) -> None:
        resolved = resolve_runner(self.runner, self.convert, self.pooler_config,
                                  self.override_pooler_config)
        for name, value in zip(("runner", "convert", "pooler_config"), resolved, strict=True):
            object.__setattr__(self, name, value)
        object.__setattr__(self, "override_pooler_config", None)  # merged into pooler_config
        if self.tokenizer_path is None:
            object.__setattr__(self, "tokenizer_path", self.path)
        resolve_dtype(self.dtype, self.device)  # validates the name
        check(self.quantization in QUANTIZATIONS,
              f"quantization={self.quantization!r} is not supported; choose one of: "
              f"{', '.join(QUANTIZATIONS)}")
        check(self.quantization in ("none", "auto") or self.device != "cuda",
              f"quantization={self.quantization!r} runs on CPUs only; use quantization='none' "
              f"on cuda")
        max_pos = self.arch.max_position_embeddings
        if self.max_model_len is None:
            object.__setattr__(self, "max_model_len", max_pos)
        check(
            isinstance(self.max_model_len, int) and 1 <= self.max_model_len <= max_pos,
            f"max_model_len={self.max_model_len!r} must be an int in [1, {max_pos}] "
            f"(the model's max_position_embeddings)",
        )
        check(isinstance(self.seed, int), f"seed={self.seed!r} must be an int")
        check(self.tokenizer_mode in ("auto", "hf"),
              f"tokenizer_mode={self.tokenizer_mode!r} is not supported; use auto (or hf): "
              f"the model's fast tokenizer")

    @property
    def is_pooling(self) -> bool:
        return self.runner == "pooling"

    @property
    def torch_dtype(self) -> torch.dtype:
        return resolve_dtype(self.dtype, self.device)
