"""The fused decode path (one C call through the layer stack) against the layer-by-layer path it
replaces: the same kernels in the same order, so logits and KV caches must be bit-identical,
step after step, with 1-5 decode rows (past the row kernels' rows_max too), float32 and
bfloat16, with and without q/k/v biases."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shardserve.model import native_kernels, quant_rows_max
from shardserve.model.attention import AttentionMetadata, allocate_kv_cache
from shardserve.model.fused_decode import FusedDecode
from shardserve.model.llama import LlamaForCausalLM
from shardserve.model.loader import iter_weights, read_arch
from shardserve.model.quantization import QuantizedTensor, QuantWeight, quantize_int8
from tests.model.test_llama import PagedRunner

pytestmark = pytest.mark.skipif(not native_kernels.compiler_available(), reason="no C compiler")


def load(path: Path, dtype: torch.dtype, quantization: str) -> LlamaForCausalLM:
    arch = read_arch(path)
    model = LlamaForCausalLM(arch, dtype, quantization=quantization)
    model.load_weights(iter_weights(path, keep_quantized=quantization == "gguf"))
    return model.eval()


def run_steps(model: LlamaForCausalLM, fused: bool, vocab: int,
              lora_slots: dict[str, int] | None = None) -> tuple[list, list]:
    """Prefill five requests, then decode steps of 5 (a verify step's 1 + 4 positions are as
    many rows), 3, 2 and 1 rows; every step's logits and the caches after them. With
    `lora_slots`, each request's tokens use that adapter slot."""
    model.model.reset_fused()
    if not fused:
        model.model._fused = None
    runner = PagedRunner(model, block_size=4, num_blocks=64, check_last_rows=False)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (7, 12, 3, 5, 9)]
    def step(reqs: list[tuple[str, list[int]]]) -> list:
        if lora_slots is not None:
            assert model.lora_batch is not None
            model.lora_batch.set([lora_slots[rid] for rid, toks in reqs for _ in toks])
        return runner.step(reqs)

    logits = step([(f"r{i}", p) for i, p in enumerate(prompts)])
    for rows in ([0, 1, 2, 3, 4], [0, 1, 2], [1, 2], [2], [0], [0, 2, 3, 4], [0, 1, 2]):
        logits = step([(f"r{i}", [(int(logits[0][-1].argmax()) + i) % vocab]) for i in rows])
    return logits, runner.caches


def assert_identical(model: LlamaForCausalLM, vocab: int,
                     lora_slots: dict[str, int] | None = None) -> None:
    want, want_caches = run_steps(model, fused=False, vocab=vocab, lora_slots=lora_slots)
    got, got_caches = run_steps(model, fused=True, vocab=vocab, lora_slots=lora_slots)
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_lora_adapters_bit_identical(tiny_qwen2_dir: Path, dtype: torch.dtype) -> None:
    """Decode rows of two adapters and the base model in one step: the fused C stack adds the
    adapters' share exactly as the layer-by-layer path does (and they change the logits)."""
    from shardserve.config.lora import LoRAConfig

    model = load(tiny_qwen2_dir, dtype, "int8")
    model.enable_lora(LoRAConfig(max_loras=2, max_lora_rank=4), dtype)
    g = torch.Generator().manual_seed(5)
    for entry in model.lora_layers.values():
        for weights in entry.values():
            weights.a.copy_(torch.randn(weights.a.shape, generator=g) * 0.3)
            weights.bt.copy_(torch.randn(weights.bt.shape, generator=g) * 0.3)
    slots = {"r0": 0, "r1": -1, "r2": 1, "r3": 1, "r4": -1}
    assert_identical(model, model.arch.vocab_size, slots)
    assert model.model._fused.takes_lora  # type: ignore[union-attr]  # and it took them
    base, _ = run_steps(model, fused=True, vocab=model.arch.vocab_size,
                        lora_slots=dict.fromkeys(slots, -1))
    adapted, _ = run_steps(model, fused=True, vocab=model.arch.vocab_size, lora_slots=slots)
    assert not torch.equal(base[0], adapted[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_past_the_row_kernels_bit_identical(tiny_qwen2_dir: Path, dtype: torch.dtype,
                                            monkeypatch) -> None:
    """Steps of more rows than a weight's rows_max: the fused stack calls the panel GEMM for
    them (csrc/decode_layers.c), as the layer-by-layer path does. rows_max lowered to 2 (before
    loading: weights keep theirs), so the 5- and 3-row steps take it."""
    for name in ("ROWS_MAX_INT16_GEMM", "ROWS_MAX_INT16_GEMM_T6K", "ROWS_MAX_BF16", "ROWS_MAX_F32",
                 "ROWS_MAX_F32_KQUANT", "ROWS_MAX_TILES", "ROWS_MAX_TILES_KQUANT"):
        monkeypatch.setattr(quant_rows_max, name, 2)
    model = load(tiny_qwen2_dir, dtype, "int8")
    assert model.model.layers[0].mlp.down_proj.qweight.rows_max(dtype) == 2
    assert_identical(model, model.arch.vocab_size)


def _q4_0(w: torch.Tensor) -> QuantizedTensor:
    """Q4_0 blocks of a float weight: d = max|w| / 8 per 32 values, q = round(w / d) + 8."""
    rows, cols = w.shape
    blocks = w.float().reshape(rows, cols // 32, 32)
    d = (blocks.abs().amax(-1, keepdim=True) / 8).clamp_min(1e-8).half()
    q = (blocks / d.float()).round().add(8).clamp(0, 15).to(torch.uint8)
    packed = q[..., :16] | (q[..., 16:] << 4)
    data = torch.cat([d.view(torch.uint8), packed], dim=-1).reshape(rows, -1).contiguous()
    return QuantizedTensor(data, 2, cols)


def test_mixed_type_segments_bit_identical(tiny_qwen2_dir: Path) -> None:
    """q/k/v in segments of two types, as a Q4_K_M file's Q4_K q/k beside a Q6_K v: the fused
    path takes the weight segment by segment, bit-identical to the layer-by-layer path."""
    model = load(tiny_qwen2_dir, torch.float32, "int8")
    for layer in model.model.layers:
        attn, qkv = layer.self_attn, layer.self_attn.qkv_proj
        q_rows, kv_rows = attn.num_heads * attn.head_dim, attn.num_kv_heads * attn.head_dim
        assert qkv.qweight is not None
        whole = qkv.qweight.dequantize(torch.float32)
        pieces = {0: _q4_0(whole[:q_rows + kv_rows]),
                  q_rows + kv_rows: quantize_int8(whole[q_rows + kv_rows:])}
        qkv.qweight = QuantWeight.from_pieces(pieces, q_rows + 2 * kv_rows)
        assert len(qkv.qweight.segments) == 2
    model.model.reset_fused()
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


def test_pipeline_stages_bit_identical(tiny_llama_dir: Path) -> None:
    """A later stage starts from the previous stage's (hidden, residual) pair."""
    arch = read_arch(tiny_llama_dir)
    stages = []
    for layer_range in ((0, 1), (1, 2)):
        stage = LlamaForCausalLM(arch, torch.float32, layer_range=layer_range,
                                 quantization="int8")
        stage.load_weights(iter_weights(tiny_llama_dir))
        stages.append(stage.eval())
    whole = load(tiny_llama_dir, torch.float32, "int8")
    whole.model._fused = None
    prompts = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]]
    caches = [allocate_kv_cache(1, 16, 4, arch.num_kv_heads, arch.head_dim, torch.float32)
              for _ in stages]
    ref = PagedRunner(whole, block_size=4, num_blocks=16, check_last_rows=False)
    ref.free = list(range(16))[::-1]  # the same blocks as below: 0, 1, 2, ...
    ref.step([(f"r{i}", p) for i, p in enumerate(prompts)])
    tables = [ref.tables[f"r{i}"] for i in range(3)]
    assert tables == [[0, 1], [2], [3]]
    meta = AttentionMetadata.build([5, 2, 3], [5, 2, 3], tables, 4)
    ids = torch.tensor([t for p in prompts for t in p])
    with torch.inference_mode():
        pair = stages[0](ids, meta, caches[0])
        stages[1](ids, meta, caches[1], intermediate=pair)
        for step in range(3):
            ids = torch.tensor([20 + step, 21 + step, 22 + step])
            want = torch.cat(ref.step([(f"r{i}", [int(t)]) for i, t in enumerate(ids)]))
            lens = [len(p) + step + 1 for p in prompts]
            tables = [ref.tables[f"r{i}"] for i in range(3)]
            meta = AttentionMetadata.build([1, 1, 1], lens, tables, 4)
            pair = stages[0](ids, meta, caches[0])
            got = stages[1].compute_logits(stages[1](ids, meta, caches[1], intermediate=pair))
            assert torch.equal(got, want)
    assert all(isinstance(s.model._fused, FusedDecode) for s in stages)
