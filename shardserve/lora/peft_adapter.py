"""A LoRA adapter folder as `peft` saves it (adapter_config.json + adapter_model.safetensors),
read into plain float32 tensors and checked against the base model's shapes.

    adapter = load_peft_adapter("/path/to/adapter", arch, max_lora_rank=16)
    adapter.modules[(0, "q_proj")].a      # float32 [r, in]   (HF's lora_A.weight)
    adapter.modules[(0, "q_proj")].b      # float32 [out, r]  (HF's lora_B.weight)
    adapter.modules[(0, "q_proj")].scaling  # alpha / r, or alpha / sqrt(r) with use_rslora

Only what the model adds as `scaling * B @ A @ x` to the seven projections of a decoder layer
is served. Everything else an adapter may carry (new embedding rows, a replaced lm_head, DoRA's
magnitudes, biases) would change the model in ways the slots cannot hold, so it is refused here,
at load, naming the field: serving such an adapter without that part would quietly give other
outputs than the adapter was trained for.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from shardserve.config.model_arch import ModelArch

# The projections an adapter may adapt, with the sub-layer they live in.
PROJECTIONS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
               "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
_KEY_RE = re.compile(r"^(?:base_model\.model\.)?(?:model\.)?layers\.(\d+)\.(self_attn|mlp)\."
                     r"(\w+)\.lora_([AB])(?:\.default)?\.weight$")
# Whole-model modules an adapter may not target (their names in HF's Llama).
_OTHER_MODULES = ("model.embed_tokens", "lm_head", "model.norm")


class LoRAError(ValueError):
    """An adapter that cannot be served; the message names the field or layer and the fix."""


@dataclass(frozen=True)
class LoRAModule:
    """One adapted projection: out += scaling * b @ (a @ x)."""

    a: torch.Tensor  # float32 [r, in]
    b: torch.Tensor  # float32 [out, r]
    scaling: float

    @property
    def rank(self) -> int:
        return self.a.shape[0]


@dataclass(frozen=True)
class PeftAdapter:
    path: str
    rank: int  # the config's r (modules may differ through rank_pattern)
    lora_alpha: float
    use_rslora: bool
    modules: dict[tuple[int, str], LoRAModule]  # (layer index, HF projection name) -> weights

    @property
    def scaling(self) -> float:
        """The config-level scaling (alpha / r, or alpha / sqrt(r) with rsLoRA)."""
        return _scaling(self.lora_alpha, self.rank, self.use_rslora)

    @property
    def max_rank(self) -> int:
        return max(m.rank for m in self.modules.values())


def _scaling(alpha: float, rank: int, rslora: bool) -> float:
    return alpha / math.sqrt(rank) if rslora else alpha / rank


def load_peft_adapter(path: str | Path, arch: ModelArch, max_lora_rank: int,
                      layers: Iterable[int] | None = None) -> PeftAdapter:
    """Read and validate the adapter at `path` for a model of shape `arch`.

    Every tensor's shape is checked for every layer; only `layers` (default all: a pipeline
    stage passes its own) are read into memory."""
    folder = _folder(path)
    cfg = _read_config(folder)
    _check_config(cfg, max_lora_rank)
    wanted = set(range(arch.num_layers) if layers is None else layers)
    pairs = _read_pairs(folder / WEIGHTS_FILE, arch, wanted)
    if not pairs:
        raise LoRAError(f"{folder / WEIGHTS_FILE} holds no lora_A/lora_B weights of the "
                        f"projections {', '.join(PROJECTIONS)}")
    rank, alpha, rslora = int(cfg["r"]), float(cfg.get("lora_alpha", 8)), bool(
        cfg.get("use_rslora", False))
    modules = {}
    for (layer, name), (a, b) in sorted(pairs.items()):
        _check_pair(layer, name, a, b, arch, max_lora_rank, cfg)
        if layer not in wanted:
            continue
        key = f"model.layers.{layer}.{PROJECTIONS[name]}.{name}"
        mod_alpha = float(_pattern_value(cfg.get("alpha_pattern") or {}, key, alpha))
        scaling = _scaling(mod_alpha, a.shape[0], rslora)
        modules[(layer, name)] = LoRAModule(a.load(), b.load(), scaling)
    return PeftAdapter(str(folder), rank, alpha, rslora, modules)


def _folder(path: str | Path) -> Path:
    folder = Path(path).expanduser()
    if not str(path) or not folder.is_dir():
        raise LoRAError(f"lora_path={str(path)!r} is not a folder: give the folder peft's "
                        f"save_pretrained wrote ({CONFIG_FILE} + {WEIGHTS_FILE})")
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        if not (folder / name).is_file():
            hint = " (only safetensors are read: save with safe_serialization=True)" if \
                name == WEIGHTS_FILE and (folder / "adapter_model.bin").exists() else ""
            raise LoRAError(f"lora_path={str(path)!r} has no {name}{hint}")
    return folder


def _read_config(folder: Path) -> dict[str, Any]:
    try:
        cfg = json.loads((folder / CONFIG_FILE).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise LoRAError(f"{folder / CONFIG_FILE} is not readable JSON: {e}") from e
    if not isinstance(cfg, dict):
        raise LoRAError(f"{folder / CONFIG_FILE} must hold a JSON object")
    return cfg


# Fields whose non-empty values change the model beyond B @ A on the seven projections.
_REFUSED = {
    "modules_to_save": "it replaces whole modules (e.g. lm_head or embed_tokens) with trained "
                       "copies; re-train without it",
    "use_dora": "DoRA's magnitude vectors are not served; merge the adapter into the base "
                "model instead",
    "lora_bias": "biases on lora_B are not served",
    "trainable_token_indices": "it trains embedding rows",
    "layer_replication": "it duplicates decoder layers",
    "target_parameters": "only modules (not parameters) can be adapted",
    "alora_invocation_tokens": "activated LoRA is not served",
    "megatron_config": "Megatron-parallel adapters are not served",
}


def _check_config(cfg: dict[str, Any], max_lora_rank: int) -> None:
    peft_type = cfg.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise LoRAError(f"peft_type={peft_type!r}: only LORA adapters are served")
    for field, why in _REFUSED.items():
        if cfg.get(field):
            raise LoRAError(f"{field}={cfg[field]!r} is not supported: {why}")
    if cfg.get("bias", "none") != "none":
        raise LoRAError(f"bias={cfg['bias']!r} is not supported (only bias='none': the "
                        f"adapter may not train biases)")
    rank = cfg.get("r")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise LoRAError(f"r={rank!r} must be an int >= 1")
    for r in [rank, *(cfg.get("rank_pattern") or {}).values()]:
        _check_rank(int(r), max_lora_rank)
    _check_targets(cfg.get("target_modules"), cfg.get("exclude_modules"))


def _check_rank(rank: int, max_lora_rank: int) -> None:
    if rank > max_lora_rank:
        raise LoRAError(f"LoRA rank {rank} is greater than max_lora_rank {max_lora_rank}: "
                        f"start the engine with max_lora_rank={rank} or more "
                        f"(--max-lora-rank {rank})")


def _check_targets(targets: Any, exclude: Any) -> None:
    """Refuse target_modules that would adapt the embedding, the LM head or the final norm."""
    if targets is None:
        raise LoRAError("target_modules is missing: name the projections the adapter adapts")
    if isinstance(targets, str) and targets.lower() == "all-linear":
        return  # peft's shorthand: every linear layer but the output layer
    hit = [m for m in _OTHER_MODULES if _matches(targets, m) and not _matches(exclude, m)]
    if hit:
        raise LoRAError(f"target_modules={targets!r} adapts {', '.join(hit)}: embedding, "
                        f"lm_head and norm adapters are not supported; only "
                        f"{', '.join(PROJECTIONS)}")


def _matches(targets: Any, key: str) -> bool:
    """peft's rule: a string is a regex matched against the whole module name; a list holds
    names matched exactly or as the name's last dotted parts."""
    if not targets:
        return False
    if isinstance(targets, str):
        return re.fullmatch(targets, key) is not None
    return any(key == t or key.endswith(f".{t}") for t in targets)


def _pattern_value(patterns: dict[str, Any], key: str, default: Any) -> Any:
    """peft's rank_pattern / alpha_pattern lookup: the first pattern matching the end of the
    module's name."""
    for pattern, value in patterns.items():
        if re.match(rf"(.*\.)?({pattern})$", key):
            return value
    return default


class _Lazy:
    """One tensor of the safetensors file: its shape now, its values when asked."""

    def __init__(self, handle: Any, key: str) -> None:
        self.handle, self.key = handle, key
        self.shape = tuple(handle.get_slice(key).get_shape())

    def load(self) -> torch.Tensor:
        return self.handle.get_tensor(self.key).to(torch.float32).contiguous()


def _read_pairs(file: Path, arch: ModelArch, wanted: set[int]
                ) -> dict[tuple[int, str], tuple[_Lazy, _Lazy]]:
    from safetensors import safe_open

    try:
        handle = safe_open(str(file), framework="pt")
    except Exception as e:  # safetensors raises its own error types
        raise LoRAError(f"{file} is not a readable safetensors file: {e}") from e
    halves: dict[tuple[int, str], dict[str, _Lazy]] = {}
    for key in handle.keys():
        match = _KEY_RE.match(key)
        if match is None or match.group(3) not in PROJECTIONS or \
                PROJECTIONS[match.group(3)] != match.group(2):
            raise LoRAError(_unknown_key(key))
        layer, name = int(match.group(1)), match.group(3)
        if layer >= arch.num_layers:
            raise LoRAError(f"adapter weight {key} is for layer {layer}, but the base model "
                            f"has {arch.num_layers} layers: the adapter was trained on "
                            f"another model")
        halves.setdefault((layer, name), {})[match.group(4)] = _Lazy(handle, key)
    pairs = {}
    for (layer, name), half in halves.items():
        if set(half) != {"A", "B"}:
            missing = "lora_B" if "A" in half else "lora_A"
            raise LoRAError(f"model.layers.{layer}.{PROJECTIONS[name]}.{name} has no "
                            f"{missing} weight in {file}")
        pairs[(layer, name)] = (half["A"], half["B"])
    return pairs


def _unknown_key(key: str) -> str:
    if "lora_magnitude_vector" in key:
        return f"adapter weight {key}: DoRA (use_dora) is not supported"
    if "embed" in key or "lora_embedding" in key:
        return f"adapter weight {key}: embedding adapters are not supported"
    if "lm_head" in key:
        return f"adapter weight {key}: lm_head adapters are not supported"
    return (f"adapter weight {key} is not a lora_A/lora_B weight of a decoder layer's "
            f"{', '.join(PROJECTIONS)}: not supported")


def expected_shape(arch: ModelArch, name: str) -> tuple[int, int]:
    """The base model's [out, in] of an HF projection."""
    q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    h, i = arch.hidden_size, arch.intermediate_size
    return {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
            "gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}[name]


def _check_pair(layer: int, name: str, a: _Lazy, b: _Lazy, arch: ModelArch,
                max_lora_rank: int, cfg: dict[str, Any]) -> None:
    where = f"model.layers.{layer}.{PROJECTIONS[name]}.{name}"
    out, inp = expected_shape(arch, name)
    rank = a.shape[0] if len(a.shape) == 2 else -1
    if len(a.shape) != 2 or len(b.shape) != 2 or a.shape[1] != inp or b.shape[0] != out or \
            b.shape[1] != rank:
        raise LoRAError(
            f"adapter layer {where} does not fit the base model: lora_A is {list(a.shape)} and "
            f"lora_B {list(b.shape)}, the base {name} needs lora_A [r, {inp}] and lora_B "
            f"[{out}, r] (its weight is [{out}, {inp}]): the adapter was trained on another "
            f"model")
    _check_rank(rank, max_lora_rank)
    want = int(_pattern_value(cfg.get("rank_pattern") or {}, where, cfg["r"]))
    if rank != want:
        raise LoRAError(f"adapter layer {where} has rank {rank} but {CONFIG_FILE} says "
                        f"r={want} (rank_pattern included): the files do not belong together")
