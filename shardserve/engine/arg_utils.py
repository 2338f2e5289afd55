"""EngineArgs: every engine option in one dataclass, as vLLM's `EngineArgs`, and the command-line
flags derived from it.

The fields are the init fields of the config dataclasses (config.py) plus `model`, each with its
default and its attribute docstring as help, so a new config field is an EngineArgs field and a
flag without editing this file:

    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    engine_args = EngineArgs.from_cli_args(parser.parse_args())
    engine = LLMEngine.from_engine_args(engine_args)
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import textwrap
from dataclasses import dataclass
from typing import Any

from shardserve.config import (
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    ModelConfig,
    MultiNodeConfig,
    ObservabilityConfig,
    ParallelConfig,
    RayConfig,
    SchedulerConfig,
)
from shardserve.config.engine import NOT_OPTIONS
from shardserve.config.lora import LoRAConfig
from shardserve.config.recovery import RecoveryConfig
from shardserve.engine.config_builder import engine_config_from_kwargs

ENGINE_CONFIGS: tuple[type, ...] = (
    EngineConfig,  # its own options only (speculative_config, enable_lora); sub-configs follow
    ModelConfig,
    CacheConfig,
    ParallelConfig,
    RayConfig,
    MultiNodeConfig,
    SchedulerConfig,
    DeviceConfig,
    ObservabilityConfig,
    RecoveryConfig,
    LoRAConfig,
)
# Fields that are not flags: those that are no options (`model` is --model, ModelConfig.device
# comes from DeviceConfig, the resolved files, the nested configs), and the replica's index.
_HIDDEN_ENGINE_FIELDS: dict[type, frozenset[str]] = {
    **{cls: frozenset(names) for cls, names in NOT_OPTIONS.items()},
    ParallelConfig: frozenset({*NOT_OPTIONS[ParallelConfig], "data_parallel_rank"}),
}
# The engine's `seed` would clash with the per-request sampling --seed.
_ENGINE_RENAMES = {"seed": "engine-seed", "engine_restart_window_s": "engine-restart-window",
                   "engine_restart_timeout_s": "engine-restart-timeout"}
# Short forms, as vLLM spells them.
_ENGINE_SHORT = {"decode_context_parallel_size": "-dcp", "prefill_context_parallel_size": "-pcp"}
# Help for fields without an attribute docstring in config.py (the docstring wins when added).
_ENGINE_HELP = {
    "tensor_parallel_size": "Ranks that shard each layer.",
    "pipeline_parallel_size": "Pipeline stages: each rank holds a contiguous slice of the "
    "layers (mp, ray, ray_v2, external_launcher).",
    "enable_chunked_prefill": "Split long prompts across steps to fit the token budget.",
}


# ---- flags derived from dataclass fields ----
@dataclass(frozen=True)
class FieldFlag:
    """One dataclass field exposed as a command-line flag."""

    field: str
    flag: str
    dest: str
    annotation: str
    default: Any
    help: str
    short: str | None = None
    """Another spelling of the flag (e.g. -dcp)."""


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """The attribute docstrings (a string literal right under a field) of a dataclass."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError, SyntaxError):
        return {}
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    docs = {}
    for node, nxt in zip(body, body[1:], strict=False):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def dataclass_flags(
    cls: type,
    prefix: str,
    hidden: frozenset[str] = frozenset(),
    renames: dict[str, str] | None = None,
    extra_help: dict[str, str] | None = None,
    shorts: dict[str, str] | None = None,
) -> list[FieldFlag]:
    """A flag per init field of `cls`: `max_model_len` -> `--max-model-len`."""
    docs = {**(extra_help or {}), **field_docs(cls)}
    flags = []
    for f in dataclasses.fields(cls):
        if not f.init or f.name in hidden:
            continue
        default = f.default if f.default is not dataclasses.MISSING else None
        name = (renames or {}).get(f.name, f.name.replace("_", "-"))
        annotation = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", "str")
        flags.append(
            FieldFlag(f.name, f"--{name}", f"{prefix}:{f.name}", annotation, default,
                      docs.get(f.name, ""), (shorts or {}).get(f.name))
        )
    return flags


def _type_parts(annotation: str) -> set[str]:
    return {p.strip() for p in annotation.split("|")} - {"None"}


def add_flags(group: argparse._ActionsContainer, flags: list[FieldFlag]) -> None:
    """Add each flag with a type from its annotation; unset flags leave no attribute."""
    for flag in flags:
        text = f"{flag.help} (default: {flag.default})".strip().replace("%", "%%")
        common = dict(dest=flag.dest, default=argparse.SUPPRESS, help=text)
        parts = _type_parts(flag.annotation)
        names = [flag.flag] if flag.short is None else [flag.short, flag.flag]
        if parts == {"bool"}:
            group.add_argument(*names, action=argparse.BooleanOptionalAction, **common)
        elif "list[int]" in parts:
            group.add_argument(*names, type=int, nargs="+", metavar="INT", **common)
        elif "list[str]" in parts:
            group.add_argument(*names, action="append", metavar="STR", **common)
        elif parts <= {"int"}:
            group.add_argument(*names, type=int, metavar="INT", **common)
        elif parts <= {"float", "int"}:
            group.add_argument(*names, type=float, metavar="FLOAT", **common)
        else:
            group.add_argument(*names, metavar="STR", **common)


def collect(args: argparse.Namespace, flags: list[FieldFlag]) -> dict[str, Any]:
    """The keyword arguments of the flags the user gave."""
    values = vars(args)
    return {f.field: values[f.dest] for f in flags if f.dest in values}


# ---- engine options ----
def engine_flags() -> list[FieldFlag]:
    flags = []
    for cls in ENGINE_CONFIGS:
        hidden = _HIDDEN_ENGINE_FIELDS.get(cls, frozenset())
        flags += dataclass_flags(cls, "engine", hidden, _ENGINE_RENAMES, _ENGINE_HELP,
                                 _ENGINE_SHORT)
    return flags


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """--model plus one flag per engine option (see config.py)."""
    group = parser.add_argument_group(
        "engine options", "Derived from the fields of shardserve/config.py. --engine-seed is "
        "the engine's seed (ModelConfig.seed); --seed is the per-request sampling seed."
    )
    group.add_argument(
        "--model", default=None, help=field_docs(ModelConfig).get("model", "model path")
    )
    add_flags(group, engine_flags())


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """Keyword arguments for `LLM(args.model, **engine_kwargs(args))`: only the flags given."""
    return collect(args, engine_flags())


# ---- EngineArgs ----
def _engine_arg_fields() -> list[tuple[str, Any, dataclasses.Field]]:
    fields = [("model", "str | None", dataclasses.field(default=None))]
    for flag in engine_flags():
        fields.append((flag.field, flag.annotation, dataclasses.field(default=flag.default)))
    return fields


class _EngineArgsMethods:
    """The methods of EngineArgs (its fields are generated from the configs)."""

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        add_engine_args(parser)
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> Any:
        return cls(model=getattr(args, "model", None), **engine_kwargs(args))

    def create_engine_config(self) -> EngineConfig:
        """The validated EngineConfig (only the options that differ from the defaults are
        passed on, so the configs' own defaults and checks apply)."""
        values = dataclasses.asdict(self)  # type: ignore[call-overload]
        model = values.pop("model")
        defaults = {f.field: f.default for f in engine_flags()}
        return engine_config_from_kwargs(
            model, **{k: v for k, v in values.items() if v != defaults.get(k)})


EngineArgs = dataclasses.make_dataclass(
    "EngineArgs", _engine_arg_fields(), bases=(_EngineArgsMethods,),
    namespace={"__doc__": "Every engine option (see config.py), as vLLM's EngineArgs.",
               "__module__": __name__})
