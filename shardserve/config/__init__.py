"""Engine configuration, plain data below the model: frozen dataclasses validated on
construction, reading no files (the construction path, engine/config_builder.py, resolves the
model first).

    model.py      DeviceConfig, ModelConfig, dtypes       parallel.py  ParallelConfig, RayConfig,
    engine.py     EngineConfig, cache, scheduler, ...                  MultiNodeConfig
    backends.py   the executor backends' table            model_arch.py ModelArch
"""

from shardserve.config.backends import BACKENDS, PP_BACKENDS
from shardserve.config.engine import (
    CacheConfig,
    EngineConfig,
    KVCacheConfig,
    ObservabilityConfig,
    SchedulerConfig,
)
from shardserve.config.model import (
    QUANTIZATIONS,
    DeviceConfig,
    ModelConfig,
    cpu_has_native_bf16,
    resolve_dtype,
)
from shardserve.config.model_arch import ModelArch
from shardserve.config.parallel import MultiNodeConfig, ParallelConfig, RayConfig

__all__ = [
    "BACKENDS", "PP_BACKENDS", "QUANTIZATIONS", "CacheConfig", "DeviceConfig", "EngineConfig",
    "KVCacheConfig", "ModelArch", "ModelConfig", "MultiNodeConfig", "ObservabilityConfig",
    "ParallelConfig", "RayConfig", "SchedulerConfig", "cpu_has_native_bf16", "resolve_dtype",
]
