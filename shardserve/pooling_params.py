"""Pooling requests (embeddings), shaped like vLLM's `PoolerConfig` and `PoolingParams`.

A pooling request computes its prompt once (prefill only, nothing sampled) and yields one
vector pooled from the final hidden states (after the model's final norm):

    LAST   the last prompt token's hidden state (vLLM's default for a causal LM)
    MEAN   the mean over every prompt token
    CLS    the first prompt token's

then L2-normalized unless `normalize` (or vLLM's newer name for it, `use_activation`) is False.
The engine's `PoolerConfig` sets the defaults; a request's `PoolingParams` may override
`normalize`. The front end resolves both into a `PoolingSpec`, which travels to the workers
inside the request's SamplingParams (`SamplingParams.pooling`) so that the scheduler and
executor need nothing new to carry it. Plain data only (pickled across processes).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

POOLING_TYPES = ("LAST", "MEAN", "CLS")


def _pooling_type(name: str, value: object) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or value.upper() not in POOLING_TYPES:
        raise ValueError(f"{name}={value!r} is not supported; choose one of "
                         f"{', '.join(POOLING_TYPES)}")
    return value.upper()


def _either(names: tuple[str, str], values: tuple[Any, Any]) -> Any:
    """One value given under two names (vLLM renamed these): they must agree."""
    a, b = values
    if a is not None and b is not None and a != b:
        raise ValueError(f"{names[0]}={a!r} and {names[1]}={b!r} disagree; they name the "
                         f"same setting, give one")
    return a if a is not None else b


def _optional_bool(name: str, value: object) -> None:
    if value is not None and not isinstance(value, bool):
        raise ValueError(f"{name} must be true, false or null, got {value!r}")


@dataclass(frozen=True)
class PoolerConfig:
    """The engine's pooling (`LLM(..., runner="pooling", pooler_config=...)`, CLI
    `--pooler-config '{"pooling_type": "MEAN"}'`). Fields vLLM has that are not listed here
    (tok_pooling_type, enable_chunked_processing, ...) are refused, naming them."""

    pooling_type: str | None = None
    seq_pooling_type: str | None = None  # vLLM's newer name for pooling_type
    normalize: bool | None = None
    use_activation: bool | None = None  # vLLM's newer name for normalize (embeddings)
    dimensions: int | None = None  # matryoshka truncation: refused (see __post_init__)
    task: str | None = None  # "embed" only

    def __post_init__(self) -> None:
        for name in ("pooling_type", "seq_pooling_type"):
            object.__setattr__(self, name, _pooling_type(name, getattr(self, name)))
        _either(("pooling_type", "seq_pooling_type"), (self.pooling_type, self.seq_pooling_type))
        for name in ("normalize", "use_activation"):
            _optional_bool(name, getattr(self, name))
        _either(("normalize", "use_activation"), (self.normalize, self.use_activation))
        if self.dimensions is not None:
            raise ValueError(f"pooler_config dimensions={self.dimensions!r} is not supported: "
                             f"the embeddings keep the model's hidden size (no matryoshka "
                             f"truncation); leave it unset")
        if self.task not in (None, "embed"):
            raise ValueError(f"pooler_config task={self.task!r} is not supported; this engine "
                             f"pools for 'embed' only")

    @property
    def resolved_type(self) -> str:
        return self.pooling_type or self.seq_pooling_type or "LAST"

    @property
    def resolved_normalize(self) -> bool:
        value = _either(("normalize", "use_activation"), (self.normalize, self.use_activation))
        return True if value is None else value


def pooler_config_from(value: object, option: str = "pooler_config") -> PoolerConfig | None:
    """A PoolerConfig from one, a dict of its fields, or a JSON object string (the CLI)."""
    if value is None or isinstance(value, PoolerConfig):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{option}={value!r} is not a JSON object: {e}") from e
    if not isinstance(value, dict):
        raise ValueError(f"{option} must be a PoolerConfig, a dict or a JSON object string, "
                         f"got {type(value).__name__}")
    known = {f.name for f in fields(PoolerConfig)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(f"{option} field(s) {', '.join(map(repr, unknown))} are not "
                         f"supported; this engine takes {', '.join(sorted(known))}")
    return PoolerConfig(**value)


@dataclass(frozen=True)
class PoolingSpec:
    """What the workers do for one pooling request (resolved by the front end)."""

    pooling_type: str  # one of POOLING_TYPES
    normalize: bool

    @property
    def needs_every_position(self) -> bool:
        """MEAN and CLS read prompt positions a prefix-cache hit would skip."""
        return self.pooling_type != "LAST"


@dataclass
class PoolingParams:
    """Per-request options of `LLM.embed`, as vLLM's PoolingParams."""

    truncate_prompt_tokens: int | None = None  # keep the last k prompt tokens; -1: max_model_len
    dimensions: int | None = None  # only the model's hidden size (no matryoshka truncation)
    normalize: bool | None = None  # None: the engine's pooler_config
    use_activation: bool | None = None  # vLLM's newer name for normalize

    def __post_init__(self) -> None:
        for name in ("normalize", "use_activation"):
            _optional_bool(name, getattr(self, name))
        _either(("normalize", "use_activation"), (self.normalize, self.use_activation))

    def resolve(self, config: PoolerConfig, hidden_size: int) -> PoolingSpec:
        """The request's PoolingSpec under the engine's config; ValueError for `dimensions`
        other than the model's hidden size."""
        if self.dimensions is not None and self.dimensions != hidden_size:
            raise ValueError(f"dimensions={self.dimensions!r} is not supported: this model's "
                             f"embeddings have {hidden_size} dimensions and cannot be "
                             f"shortened (no matryoshka training); omit dimensions")
        normalize = _either(("normalize", "use_activation"), (self.normalize,
                                                              self.use_activation))
        return PoolingSpec(config.resolved_type,
                           config.resolved_normalize if normalize is None else normalize)
