"""GGUF weights kept quantized are used where they lie in the file: views of its map, llama Q/K
rows in the file's order, copies only where a layout needs them, and a loaded model's resident
memory about the file's tensor bytes (measured in a fresh interpreter)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from shardserve.model import native_kernels as nk
from shardserve.model.gguf_loader import read_gguf, unpermute_rope_rows
from shardserve.model.huge_pages import HUGE_PAGE, huge_pages_on
from shardserve.model.layers import rope_interleave_perm
from shardserve.model.llama import LlamaForCausalLM
from shardserve.model.loader import iter_weights, read_arch
from shardserve.model.quantization import QuantizedTensor

pytestmark = pytest.mark.skipif(not nk.compiler_available(), reason="no C compiler")


def map_range(path: Path) -> tuple[int, int]:
    _, mm = read_gguf(path)
    start = np.frombuffer(mm, dtype=np.uint8).ctypes.data
    return start, start + len(mm)


def in_map(t: torch.Tensor, bounds: tuple[int, int]) -> bool:
    return bounds[0] <= t.data_ptr() and t.data_ptr() + t.numel() <= bounds[1]


def test_quantized_weights_are_views_of_the_file(default_model_path: Path) -> None:
    bounds = map_range(default_model_path)
    quantized = {name: t for name, t in iter_weights(default_model_path, keep_quantized=True)
                 if isinstance(t, QuantizedTensor)}
    assert len(quantized) == 30 * 7 + 1  # every linear and the embedding
    for name, t in quantized.items():
        assert in_map(t.data, bounds), name
        assert t.rope_interleaved == (".q_proj." in name or ".k_proj." in name), name


def test_file_order_of_q_and_k_is_the_models_order(default_model_path: Path) -> None:
    """The model computes RoPE on interleaved pairs (rope_interleave_perm of HF's rows); the
    GGUF converter stored exactly that order, so the loader's HF order (checked against
    transformers in test_loader) permuted the model's way gives back the file's rows."""
    arch = read_arch(default_model_path)
    weights = dict(iter_weights(default_model_path, keep_quantized=True))
    for name, heads in (("q_proj", arch.num_heads), ("k_proj", arch.num_kv_heads)):
        stored = weights[f"model.layers.3.self_attn.{name}.weight"].data
        hf = torch.from_numpy(unpermute_rope_rows(stored.numpy(), heads))
        perm = rope_interleave_perm(arch.head_dim)
        rows = torch.arange(heads).unsqueeze(1) * arch.head_dim + perm
        assert torch.equal(hf[rows.reshape(-1)], stored)


def test_loaded_layers_keep_file_views_where_no_repack_applies(default_model_path,
                                                               monkeypatch) -> None:
    """With the portable kernels (no R4 / R8 repack) and huge pages off: o, down, the embedding
    and gate_up (two tensors back to back in the file, one view) stay in the map; q/k/v is one
    copy (its three tensors are apart in the file, and the fused decode takes one segment per
    linear)."""
    monkeypatch.setenv("SHARDSERVE_HUGE_PAGES", "0")
    bounds = map_range(default_model_path)
    arch = read_arch(default_model_path)
    with nk.using(nk.build_library(nk.PORTABLE_ARCH)):
        model = LlamaForCausalLM(arch, torch.float32, quantization="gguf")
        model.load_weights(iter_weights(default_model_path, keep_quantized=True))
    assert in_map(model.model.embed_tokens.qweight.segments[0][1].data, bounds)
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for module in (attn.o_proj, mlp.gate_up_proj, mlp.down_proj, attn.qkv_proj):
            assert module.qweight is not None and len(module.qweight.segments) == 1
            data = module.qweight.segments[0][1].data
            assert in_map(data, bounds) == (module is not attn.qkv_proj)


@pytest.mark.skipif(not huge_pages_on(), reason="no transparent huge pages here")
def test_streamed_weights_are_copied_into_huge_pages(default_model_path) -> None:
    """With huge pages on (the default) every weight a product streams leaves the map for
    huge-page memory: the tied embedding (the LM head's table, Q8_0 49152 x 576, 30 MB) from a
    2 MiB boundary, the layers' smaller ones packed into shared maps."""
    bounds = map_range(default_model_path)
    arch = read_arch(default_model_path)
    with nk.using(nk.build_library(nk.PORTABLE_ARCH)):
        model = LlamaForCausalLM(arch, torch.float32, quantization="gguf")
        model.load_weights(iter_weights(default_model_path, keep_quantized=True))
    table = model.model.embed_tokens.qweight.segments[0][1].data
    assert not in_map(table, bounds) and table.data_ptr() % HUGE_PAGE == 0
    assert model.lm_head.qweight.segments[0][1].data.data_ptr() == table.data_ptr()
    for layer in model.model.layers:
        for module in (layer.self_attn.qkv_proj, layer.mlp.down_proj):
            assert not in_map(module.qweight.segments[0][1].data, bounds)


_MEASURE = """
import json, os, sys, time
def resident(path):
    # Anonymous memory plus the pages of `path`'s maps: shared libraries' code pages, touched
    # for the first time by the load's code paths, vary by machine and are not the weights'.
    with open("/proc/self/status") as f:
        anon = next(int(l.split()[1]) for l in f if l.startswith("RssAnon:"))
    mapped, ours = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and ":" not in head[0]:  # a mapping's first line
                ours = len(head) >= 6 and os.path.realpath(head[-1]) == path
            elif ours and head[0] == "Rss:":
                mapped += int(head[1])
    return (anon + mapped) * 1024
import torch
from shardserve.model import native_kernels
from shardserve.model.gguf_loader import _nbytes, hf_name, read_gguf
from shardserve.model.llama import LlamaForCausalLM
from shardserve.model.loader import iter_weights, read_arch
native_kernels.library()
path = os.path.realpath(sys.argv[1])
before, t0 = resident(path), time.perf_counter()
gf, _ = read_gguf(path)
model = LlamaForCausalLM(read_arch(path), torch.float32, quantization="gguf")
model.load_weights(iter_weights(path, keep_quantized=True))
tensor_bytes = sum(_nbytes(t) for t in gf.tensors if hf_name(t.name))
print(json.dumps({"grew": resident(path) - before, "tensor_bytes": tensor_bytes,
                  "seconds": time.perf_counter() - t0}))
"""
# Beside the weights: the header's metadata as Python objects (49k tokens and merges, ~9 MiB),
# its pages of the map (~2 MiB) and the empty model's modules (~8 MiB). Counted: anonymous
# memory and the file's map (not the code pages of libraries the load touches first).
SLACK = 24 << 20


def test_default_model_resident_memory_after_load(default_model_path: Path) -> None:
    env = {**os.environ, "SHARDSERVE_QUANT_DENSE_BATCHES": "0"}  # no dense copy kept
    out = subprocess.run([sys.executable, "-c", _MEASURE, str(default_model_path)], env=env,
                         capture_output=True, text=True, timeout=120, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"\nload: RSS +{got['grew'] / 2**20:.1f} MiB for {got['tensor_bytes'] / 2**20:.1f} "
          f"MiB of tensors, {got['seconds']:.2f} s")
    assert got["grew"] <= got["tensor_bytes"] * 1.1 + SLACK
