"""transformers' model of the default GGUF and its greedy continuations, shared by every test
process of a checkout.

Several test files check the default model's greedy output against transformers' (DP, PP on
mp and on Ray, two nodes, the server); each used to load transformers' model (~13 s) and run
its generate (~1 s a prompt) in its own process: once per pytest-xdist worker and once more in
each Ray file's interpreter. The continuations are a function of the prompt, the GGUF file and
the torch and transformers versions, so they are computed once, by whichever process asks
first, and kept as small JSON files:

    <folder>/<sha256(model identity, versions, n, prompt ids)>.json   [token id, ...]

A lock file serialises the computing (the second asker waits, then reads). Without a folder
(pytest's cache disabled) every process computes its own, as before.

transformers' own load of the GGUF takes ~18 s a process (of which dequantizing is ~2 s), a
load of the same float32 weights saved as safetensors ~0.3 s, so the first load is saved:

    <folder>/<sha256(model identity, versions)>/   config.json, generation_config.json,
                                                   model.safetensors (float32)

Measured equal to the GGUF load (torch 2.x, the pinned transformers): every parameter and
buffer, the logits and generate's tokens in float32, and every parameter, buffer (RoPE's
inv_freq stays float32) and the logits when loaded as bfloat16.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any


class HfGreedyOracle:
    def __init__(self, load_model: Callable[[], Any], model_file: Path,
                 folder: Path | None) -> None:
        self._load_model = load_model  # called only when a continuation is missing
        self._folder = folder
        self._memo: dict[str, list[int]] = {}
        self._identity = _identity(model_file)

    def __call__(self, ids: list[int], n: int = 32) -> list[int]:
        key = hashlib.sha256(json.dumps([self._identity, n, ids]).encode()).hexdigest()
        if key not in self._memo:
            self._memo[key] = self._stored(key) or self._compute_and_store(key, ids, n)
        return self._memo[key]

    def _stored(self, key: str) -> list[int] | None:
        if self._folder is None:
            return None
        try:
            return json.loads((self._folder / f"{key}.json").read_text())
        except (FileNotFoundError, ValueError):  # none yet, or a torn write from a crash
            return None

    def _compute_and_store(self, key: str, ids: list[int], n: int) -> list[int]:
        with self._locked():
            done = self._stored(key)  # another process may have computed it while we waited
            if done is not None:
                return done
            tokens = _greedy(self._load_model(), ids, n)
            if self._folder is not None:
                tmp = self._folder / f"{key}.{os.getpid()}.tmp"
                tmp.write_text(json.dumps(tokens))
                os.replace(tmp, self._folder / f"{key}.json")  # readers see all or nothing
            return tokens

    def _locked(self) -> contextlib.AbstractContextManager:
        return _locked(self._folder) if self._folder is not None else contextlib.nullcontext()


@contextlib.contextmanager
def _locked(folder: Path) -> Iterator[None]:
    with open(folder / "lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # released when the file closes, also on a crash
        yield


def hf_model(model_file: Path, dtype_name: str, folder: Path | None) -> Any:
    """transformers' model of the GGUF `model_file` in `dtype_name` (eval mode)."""
    import torch
    import transformers

    dtype = getattr(torch, dtype_name)
    if folder is None:
        return _from_gguf(model_file, dtype)
    key = hashlib.sha256(json.dumps(_identity(model_file)).encode()).hexdigest()
    saved = folder / key
    with _locked(folder):
        if not (saved / "model.safetensors").exists():
            _save(_from_gguf(model_file, torch.float32), saved)
    return transformers.AutoModelForCausalLM.from_pretrained(saved, dtype=dtype).eval()


def _from_gguf(model_file: Path, dtype: Any) -> Any:
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        model_file.parent, gguf_file=model_file.name, dtype=dtype).eval()


def _save(model: Any, saved: Path) -> None:
    """The float32 weights as a plain checkpoint (save_pretrained refuses a GGUF-loaded model;
    the config drops the GGUF marker: these weights are not quantized)."""
    import shutil

    from safetensors.torch import save_model

    tmp = saved.with_name(f"{saved.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    config = model.config
    quantization = config.__dict__.pop("quantization_config", None)
    try:
        config.save_pretrained(tmp)
    finally:
        if quantization is not None:
            config.quantization_config = quantization
    model.generation_config.save_pretrained(tmp)
    save_model(model, str(tmp / "model.safetensors"))  # tied tensors saved once
    os.replace(tmp, saved)  # readers see a whole checkpoint or none


def _identity(model_file: Path) -> list[Any]:
    import torch
    import transformers

    stat = model_file.stat()
    return [str(model_file.resolve()), stat.st_size, stat.st_mtime_ns, torch.__version__,
            transformers.__version__]


def _greedy(hf_model: Any, ids: list[int], n: int) -> list[int]:
    import torch

    with torch.no_grad():
        ref = hf_model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                                eos_token_id=2)
    return ref[0, len(ids):].tolist()


def argmax_greedy(model: Any, prompts: list[list[int]], n: int) -> list[list[int]]:
    """Greedy argmax over an HF (or peft) model's full-sequence logits, n tokens each, EOS not
    special (ignore_eos): the oracle for the tiny random models."""
    import torch

    out = []
    with torch.no_grad():
        for ids in prompts:
            seq = list(ids)
            for _ in range(n):
                seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
            out.append(seq[len(ids):])
    return out
