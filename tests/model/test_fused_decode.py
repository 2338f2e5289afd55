"""The fused decode path (one C call through the layer stack) against the layer-by-layer path it
replaces: the same kernels in the same order, so logits and KV caches must be bit-identical,
step after step, with 1-3 decode rows, float32 and bfloat16, with and without q/k/v biases."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shardserve.config import ModelConfig
from shardserve.model import native_kernels
from shardserve.model.fused_decode import FusedDecode
from shardserve.model.llama import LlamaForCausalLM
from shardserve.model.loader import iter_weights
from tests.model.test_llama import PagedRunner

pytestmark = pytest.mark.skipif(not native_kernels.compiler_available(), reason="no C compiler")


def load(path: Path, dtype: torch.dtype, quantization: str) -> LlamaForCausalLM:
    arch = ModelConfig(model=str(path)).arch
    model = LlamaForCausalLM(arch, dtype, quantization=quantization)
    model.load_weights(iter_weights(path, keep_quantized=quantization == "gguf"))
    return model.eval()


def run_steps(model: LlamaForCausalLM, fused: bool, vocab: int) -> tuple[list, list]:
    """Prefill three requests, then decode steps of 3, 2 and 1 rows; every step's logits and
    the caches after them."""
    model.model.reset_fused()
    if not fused:
        model.model._fused = None
    runner = PagedRunner(model, block_size=4, num_blocks=64, check_last_rows=False)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (7, 12, 3)]
    logits = runner.step([(f"r{i}", p) for i, p in enumerate(prompts)])
    for rows in ([0, 1, 2], [0, 1, 2], [1, 2], [2], [0], [0, 2], [0, 1, 2]):
        step = [(f"r{i}", [(int(logits[0][-1].argmax()) + i) % vocab]) for i in rows]
        logits = runner.step(step)
    return logits, runner.caches


def assert_identical(model: LlamaForCausalLM, vocab: int) -> None:
    want, want_caches = run_steps(model, fused=False, vocab=vocab)
    got, got_caches = run_steps(model, fused=True, vocab=vocab)
    assert isinstance(model.model._fused, FusedDecode), "the fused path was not taken"
    for a, b in zip(want, got, strict=True):
        assert torch.equal(a, b)
    for a, b in zip(want_caches, got_caches, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_default_model_gguf_bit_identical(default_model_path: Path, dtype: torch.dtype) -> None:
    model = load(default_model_path, dtype, "gguf")
    assert_identical(model, model.arch.vocab_size)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_int8_with_qkv_bias_bit_identical(tiny_qwen2_dir: Path, dtype: torch.dtype) -> None:
    model = load(tiny_qwen2_dir, dtype, "int8")
    assert model.model.layers[0].self_attn.qkv_proj.bias is not None
    assert_identical(model, model.arch.vocab_size)


def test_not_built_where_it_does_not_apply(tiny_llama_dir: Path, monkeypatch) -> None:
    dense = load(tiny_llama_dir, torch.float32, "none")
    assert dense.model._fused_decode() is None  # nothing quantized
    quantized = load(tiny_llama_dir, torch.float32, "int8")
    assert isinstance(quantized.model._fused_decode(), FusedDecode)
    monkeypatch.setenv("SHARDSERVE_FUSED_DECODE", "0")
    quantized.model.reset_fused()
    assert quantized.model._fused_decode() is None


def test_reload_rebuilds_the_table(tiny_llama_dir: Path) -> None:
    """Loading weights again frees the old blocks: the table must not keep pointing at them."""
    model = load(tiny_llama_dir, torch.float32, "int8")
    first, _ = run_steps(model, fused=True, vocab=model.arch.vocab_size)
    model.load_weights(iter_weights(tiny_llama_dir))
    assert model.model._fused is False  # forgotten until the next decode step
    again, _ = run_steps(model, fused=True, vocab=model.arch.vocab_size)
    for a, b in zip(first, again, strict=True):
        assert torch.equal(a, b)
