"""Profiling: torch's profiler in one process (a rank, or an engine core), one Chrome trace each.

    engine core.start_profile(config) ──collective_rpc──▶ Worker.start_profile on every rank
    ... steps ...
    engine core.stop_profile()  ──────────────────────▶ Worker.stop_profile: each rank writes
        DIR/trace_dp<d>_pp<p>_tp<t>.json (..._pp<p>_pcp<c>_tp<t> with PCP); the core writes
        DIR/trace_engine_core_dp<d>.json

The files are torch's Chrome-trace JSON, which Perfetto (ui.perfetto.dev) and chrome://tracing
read; a later profile writes the same names again (move the files to keep them). A process
profiles once at a time: a second start while one runs is refused, as is a stop without a
start. Where a rank runs inside the engine core's own process (the `uni` and
`external_launcher` backends) torch allows one profiler there, so the rank's trace is the only
one and holds the core's work too.

Our CPU kernels (model/native_kernels.py: attention, norms, RoPE, the quantized and LoRA
products, the fused decode layers) are C called through ctypes, which torch's profiler cannot
see. While a profile runs, every call into that library is wrapped in a
`torch.profiler.record_function("kernel::<C function>")` range, and each model step in
"shardserve::execute_step" (a rank) or "shardserve::engine_step" (a core), so the trace names
them. The wrapping is put in place at start and taken away at stop (native_kernels.wrap_calls;
the step method is swapped), so profiling costs one None check a kernel call when off.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch.profiler import ProfilerActivity, profile, record_function

from shardserve.model import native_kernels

logger = logging.getLogger(__name__)

KERNEL_PREFIX = "kernel::"
ENGINE_STEP_LABEL = "shardserve::engine_step"
RANK_STEP_LABEL = "shardserve::execute_step"


@dataclass(frozen=True)
class ProfilerConfig:
    """What to profile and where the traces go (vLLM's `--profiler-config` fields we take)."""

    torch_profiler_dir: str
    profiler: str = "torch"
    torch_profiler_record_shapes: bool = False
    torch_profiler_with_stack: bool = False
    torch_profiler_with_memory: bool = False

    def __post_init__(self) -> None:
        if self.profiler != "torch":
            raise ValueError(f"profiler={self.profiler!r} is not supported; use \"torch\"")
        if not isinstance(self.torch_profiler_dir, str) or not self.torch_profiler_dir:
            raise ValueError(f"torch_profiler_dir={self.torch_profiler_dir!r} must be a folder "
                             f"path (where each process writes its trace)")

    @classmethod
    def parse(cls, value: ProfilerConfig | dict | str | None = None,
              profiler_dir: str | None = None) -> ProfilerConfig | None:
        """From `--profiler-config` (a JSON object, or its dict) and/or `--profiler-dir`;
        None when neither is given (profiling off). Unknown keys are refused, naming them."""
        if isinstance(value, ProfilerConfig):
            return value
        fields = _config_fields(value)
        if profiler_dir is not None:
            fields["torch_profiler_dir"] = profiler_dir
        if not fields:
            return None
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(fields) - known)
        if unknown:
            raise ValueError(f"profiler config keys {unknown} unknown; supported: "
                             f"{sorted(known)}")
        if "torch_profiler_dir" not in fields:
            raise ValueError("the profiler config needs torch_profiler_dir (or --profiler-dir): "
                             "the folder the traces are written to")
        return cls(**fields)


def _config_fields(value: dict | str | None) -> dict[str, Any]:
    if value is None:
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"--profiler-config is not valid JSON ({e}); give e.g. "
                             f"'{{\"profiler\": \"torch\", \"torch_profiler_dir\": \"DIR\"}}'"
                             ) from e
    if not isinstance(value, dict):
        raise ValueError(f"the profiler config must be a JSON object, got {value!r}")
    return dict(value)


def required(config: ProfilerConfig | None, owner: str) -> ProfilerConfig:
    """`config`, or RuntimeError saying how to configure profiling on `owner` (LLM, AsyncLLM)."""
    if config is None:
        raise RuntimeError(f"profiling is not configured: make the {owner} with profiler_config="
                           f"{{'profiler': 'torch', 'torch_profiler_dir': DIR}}")
    return config


def rank_trace_name(dp: int, pp: int, tp: int, pcp: int | None = None) -> str:
    """pcp: the context shard, named only under prefill context parallelism (None)."""
    shard = "" if pcp is None else f"_pcp{pcp}"
    return f"trace_dp{dp}_pp{pp}{shard}_tp{tp}.json"


def engine_trace_name(dp: int) -> str:
    return f"trace_engine_core_dp{dp}.json"


# The profile running in this process, if any: torch's profiler allows one per process.
_active: TraceProfiler | None = None


def active_in_process() -> bool:
    return _active is not None


class TraceProfiler:
    """One process's profile: start, run, stop writes `DIR/<file_name>`.

    `owner.<step_method>` is labelled per call while the profile runs, and every call into the
    native kernel library by its C function's name."""

    def __init__(self, who: str, file_name: str, owner: object, step_method: str,
                 step_label: str, cuda: bool = False) -> None:
        self.who = who  # for messages: "rank 1", "engine core 0"
        self.file_name = file_name
        self._owner, self._step_method, self._step_label = owner, step_method, step_label
        self._cuda = cuda
        self._profile: profile | None = None
        self._config: ProfilerConfig | None = None

    @property
    def running(self) -> bool:
        return self._profile is not None

    def start(self, config: ProfilerConfig) -> None:
        global _active
        if self.running:
            raise RuntimeError(f"{self.who}: a profile is already running; call stop_profile "
                               f"first")
        if _active is not None:
            raise RuntimeError(f"{self.who}: this process already runs a profile "
                               f"({_active.who}'s); torch allows one per process")
        Path(config.torch_profiler_dir).mkdir(parents=True, exist_ok=True)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self._cuda else [])
        prof = profile(activities=activities, record_shapes=config.torch_profiler_record_shapes,
                       with_stack=config.torch_profiler_with_stack,
                       profile_memory=config.torch_profiler_with_memory)
        prof.start()
        self._profile, self._config, _active = prof, config, self
        _label_kernels(True)
        step = getattr(self._owner, self._step_method)
        setattr(self._owner, self._step_method, _labelled(step, self._step_label))

    def stop(self) -> str:
        """Stop, write the trace, return its path."""
        global _active
        if self._profile is None or self._config is None:
            raise RuntimeError(f"{self.who}: no profile is running; call start_profile first")
        prof, config = self._profile, self._config
        self._profile = self._config = None
        _active = None
        _label_kernels(False)
        vars(self._owner).pop(self._step_method, None)  # the class's own method again
        prof.stop()
        path = Path(config.torch_profiler_dir) / self.file_name
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        prof.export_chrome_trace(str(tmp))
        os.replace(tmp, path)  # a reader never sees half a trace
        logger.info("%s: profile written to %s", self.who, path)
        return str(path)


def _labelled(fn: Callable[..., Any], label: str) -> Callable[..., Any]:
    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        with record_function(label):
            return fn(*args, **kwargs)
    return run


class _LabelledLibrary:
    """The kernel library, each C function wrapped in a profiler range named after it."""

    def __init__(self, lib: Any) -> None:
        self._lib = lib

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self._lib, name)
        wrapped = _labelled(fn, KERNEL_PREFIX + name) if callable(fn) else fn
        setattr(self, name, wrapped)  # found directly from now on
        return wrapped


def _label_kernels(on: bool) -> None:
    """Have native_kernels hand out labelled functions (one view per library: tests may swap
    the library), or the plain library again."""
    if not on:
        native_kernels.wrap_calls(None)
        return
    views: dict[int, _LabelledLibrary] = {}

    def labelled(lib: Any) -> _LabelledLibrary:
        if id(lib) not in views:
            views[id(lib)] = _LabelledLibrary(lib)
        return views[id(lib)]
    native_kernels.wrap_calls(labelled)


def trace_event_names(path: str | Path) -> set[str]:
    """The names of the events in a Chrome trace file (what a test or a script checks)."""
    with open(path) as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    return {e.get("name", "") for e in events}
