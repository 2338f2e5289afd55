"""The construction path of the engine's configuration: flat options -> a validated EngineConfig.

The configs are plain data (config/ reads no files); this is where the model is resolved: the
default model found, its architecture read, the quantized path chosen from the file's contents.
`LLM(...)`, the CLI, the server and `EngineArgs.create_engine_config` all come through here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from shardserve.config import (
    QUANTIZATIONS,
    DeviceConfig,
    EngineConfig,
    ModelConfig,
    MultiNodeConfig,
    ParallelConfig,
    RayConfig,
)
from shardserve.config.checks import check
from shardserve.config.engine import OWNERS, group_options
from shardserve.model.gguf_loader import has_kept_quantized_weights
from shardserve.model.loader import read_arch, resolve_model_path


def engine_config_from_kwargs(model: str | None = None, **kwargs: Any) -> EngineConfig:
    """Build from flat keyword arguments, as `LLM(...)` and the CLI take them."""
    groups = group_options(kwargs)
    device = DeviceConfig(**groups.pop("device_config", {}))
    model_config = model_config_for(model, device=device.device,
                                     **groups.pop("model_config", {}))
    parallel = ParallelConfig(ray=RayConfig(**groups.pop("ray", {})),
                              multinode=MultiNodeConfig(**groups.pop("multinode", {})),
                              **groups.pop("parallel_config", {}))
    top = groups.pop("engine_config", {})  # EngineConfig's own options (speculative_config)
    built = {name: OWNERS[name](**kw) for name, kw in groups.items()}
    return EngineConfig(model_config=model_config, device_config=device,
                        parallel_config=parallel, **top, **built)


def model_config_for(model: str | None = None, *, tokenizer: str | None = None,
                     device: str = "cpu", **options: Any) -> ModelConfig:
    """A ModelConfig for `model` (None: the default model) with its files resolved."""
    path = resolve_model_path(model)
    tokenizer_path = resolve_model_path(tokenizer) if tokenizer is not None else path
    quantization = resolve_quantization(options.pop("quantization", "auto"), path,
                                        options.get("dtype", "auto"), device)
    return ModelConfig(model=model, tokenizer=tokenizer, path=path,
                       tokenizer_path=tokenizer_path, arch=read_arch(path), device=device,
                       quantization=quantization, **options)


def resolve_quantization(choice: str, path: Path, dtype: str, device: str) -> str:
    """`auto` -> gguf for a GGUF file holding kept-quantized matrices (dtype auto, CPU), else
    none; an explicit choice is checked against the file."""
    check(choice in QUANTIZATIONS,
          f"quantization={choice!r} is not supported; choose one of: {', '.join(QUANTIZATIONS)}")
    is_gguf = path.is_file()
    if choice == "auto":
        quantized = is_gguf and dtype == "auto" and device != "cuda"
        return "gguf" if quantized and has_kept_quantized_weights(path) else "none"
    check(choice != "gguf" or is_gguf,
          f"quantization='gguf' needs a .gguf model file, got the folder {str(path)!r}; "
          f"use quantization='int8' to quantize its weights at load, or 'none'")
    return choice
