"""The default model computed from its GGUF blocks (quantization="gguf") against the same file
dequantized to float32 (quantization="none"), and the option's resolution.

Teacher forcing: for each of the 8 oracle prompts the float32 model's greedy continuation fixes
a sequence; both models then read the same 64 positions, once as one prefill (the batched path:
the panel GEMM from the blocks, csrc/quant_gemm.c) and once token by token (the integer decode
path, three sequences a step), and their top-1 tokens must agree at >= 99.9% of the 512
positions with float32 activations (measured: 100% both ways, mean |dlogit| 0.0000 prefill,
0.0009 token by token). With bfloat16 activations (what dtype="auto" picks on CPUs with native
bfloat16) the activations' rounding dominates: the dense bfloat16 model without quantization
agrees at 97.5-97.7% on these positions, the quantized one at 97.9% (prefill) and 98.2-98.8%
(token by token); asserted >= 97%.
Printed: agreement and mean |logit difference| (pytest -s shows them).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shardserve.config.model_arch import ModelArch
from shardserve.engine.config_builder import model_config_for
from shardserve.model import native_kernels
from shardserve.model.llama import LlamaForCausalLM
from shardserve.model.loader import iter_weights, load_tokenizer, read_arch
from shardserve.model.quant_rows_max import ROWS_MAX_BF16
from shardserve.model.quantization import QuantWeight
from tests.entrypoints.pp_oracle import CHAT_PROMPTS, RAW_PROMPTS
from tests.model.test_llama import PagedRunner

POSITIONS = 64
pytestmark = pytest.mark.skipif(not native_kernels.compiler_available(), reason="no C compiler")


def load(path: Path, arch: ModelArch, dtype: torch.dtype, quantization: str) -> LlamaForCausalLM:
    model = LlamaForCausalLM(arch, dtype, quantization=quantization)
    model.load_weights(iter_weights(path, keep_quantized=quantization == "gguf"))
    return model.eval()


@pytest.fixture(scope="module")
def reference(default_model_path: Path) -> LlamaForCausalLM:
    arch = read_arch(default_model_path)
    return load(default_model_path, arch, torch.float32, "none")


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def quantized(request, default_model_path: Path) -> LlamaForCausalLM:
    arch = read_arch(default_model_path)
    return load(default_model_path, arch, request.param, "gguf")


@pytest.fixture(scope="module")
def sequences(default_model_path: Path, reference) -> list[list[int]]:
    """Each prompt followed by the float32 model's greedy tokens, POSITIONS + 1 in all (the 8
    decoded together, one step for all: they are only the texts the models are read on)."""
    tok = load_tokenizer(default_model_path)
    seqs = [tok.encode(text) for text in RAW_PROMPTS + CHAT_PROMPTS]
    runner = PagedRunner(reference, block_size=16, num_blocks=96, check_last_rows=False)
    new = [list(ids) for ids in seqs]
    while any(len(ids) < POSITIONS + 1 for ids in seqs):
        logits = runner.step([(str(i), toks) for i, toks in enumerate(new)])
        new = [[int(rows[-1].argmax())] for rows in logits]
        for ids, (tok_id,) in zip(seqs, new, strict=True):
            ids.append(tok_id)
    return [ids[: POSITIONS + 1] for ids in seqs]


@pytest.fixture(scope="module")
def reference_logits(reference, sequences) -> list[torch.Tensor]:
    """The float32 model's logits over each sequence (what every comparison reads)."""
    return teacher_forced(reference, sequences, one_by_one=False)


def teacher_forced(model: LlamaForCausalLM, seqs: list[list[int]], one_by_one: bool
                   ) -> list[torch.Tensor]:
    """Each sequence's logits over its first POSITIONS tokens: one prefill each, or token by
    token, a few sequences a step (at most ROWS_MAX_BF16: the integer decode path in any dtype)."""
    if not one_by_one:
        return [PagedRunner(model, block_size=16, num_blocks=64, check_last_rows=False)
                .step([("r", seq[:POSITIONS])])[0] for seq in seqs]
    out = []
    for start in range(0, len(seqs), ROWS_MAX_BF16):
        group = seqs[start:start + ROWS_MAX_BF16]
        runner = PagedRunner(model, block_size=16, num_blocks=64 * len(group),
                             check_last_rows=False)
        steps = [runner.step([(str(i), [seq[p]]) for i, seq in enumerate(group)])
                 for p in range(POSITIONS)]
        out += [torch.cat([rows[i] for rows in steps]) for i in range(len(group))]
    return out


def test_gguf_weights_stay_quantized(quantized) -> None:
    layer = quantized.model.layers[0]
    for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                   layer.mlp.down_proj):
        assert isinstance(linear.qweight, QuantWeight)
        assert [seg.type_name for _, seg in linear.qweight.segments] == ["Q4_1"]
        assert linear.weight.stride() == (0, 0)  # no dense copy kept
    assert quantized.lm_head.qweight is quantized.model.embed_tokens.qweight
    assert quantized.lm_head.qweight.segments[0][1].type_name == "Q8_0"


@pytest.mark.parametrize("one_by_one", [False, True], ids=["prefill", "decode"])
def test_top1_agrees_with_dequantized_float32(reference_logits, quantized, sequences,
                                              one_by_one: bool) -> None:
    agree, total, diffs = 0, 0, []
    for want, got in zip(reference_logits, teacher_forced(quantized, sequences, one_by_one),
                         strict=True):
        agree += int((want.argmax(-1) == got.argmax(-1)).sum())
        total += want.shape[0]
        diffs.append((want - got).abs().mean())
    rate = agree / total
    print(f"\nquantization=gguf, {quantized.dtype} ({'decode' if one_by_one else 'prefill'}): "
          f"top-1 agreement {agree}/{total} = {rate:.2%}, "
          f"mean |dlogit| {torch.stack(diffs).mean():.4f}")
    assert total == 8 * POSITIONS
    assert rate >= (0.999 if quantized.dtype == torch.float32 else 0.97)


def test_resolution(default_model_path: Path, tmp_path: Path) -> None:
    path = str(default_model_path)
    assert model_config_for(path).quantization == "gguf"
    assert model_config_for(path, dtype="float32").quantization == "none"
    assert model_config_for(path, dtype="float32", quantization="gguf").quantization == "gguf"
    assert model_config_for(path, quantization="int8").quantization == "int8"
    with pytest.raises(ValueError, match=r"quantization='awq' is not supported.*gguf, int8"):
        model_config_for(path, quantization="awq")
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text(
        '{"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,'
        ' "num_attention_heads": 4, "num_hidden_layers": 2, "vocab_size": 100,'
        ' "tie_word_embeddings": true}'
    )
    assert model_config_for(str(folder)).quantization == "none"
    with pytest.raises(ValueError, match=r"quantization='gguf' needs a \.gguf model file"):
        model_config_for(str(folder), quantization="gguf")


@pytest.fixture(scope="module")
def int8_level() -> object:
    """The AVX2 build, int8 activations on, the weights kept as blocks (SHARDSERVE_TILES=0: its
    Q4_0 / Q4_1 / Q8_0 / Q4_K tiles keep int16 x), so that its rows take every type."""
    if "avx2" not in native_kernels.levels_buildable_here():
        pytest.skip("this CPU cannot run the AVX2 level")
    lib = native_kernels.build_level("avx2")
    lib.quant_set_int8_activations(1)
    with native_kernels.using(lib), pytest.MonkeyPatch.context() as mp:
        mp.setenv("SHARDSERVE_TILES", "0")
        yield lib
    lib.quant_set_int8_activations(0)


def test_int8_activations_agree_as_bfloat16_does(int8_level, default_model_path: Path,
                                                 reference_logits, sequences) -> None:
    """SHARDSERVE_INT8_ACTIVATIONS (csrc/quant_rows_int8.c) on the token-by-token path, float32
    otherwise: x's int8 rounding per 32 costs about what bfloat16 activations do (97.5-98.8%
    above). Measured (Zen 4, AVX2 build): 500/512 = 97.66%, mean |dlogit| 0.196 (int16: 0.0009,
    so the bound below also shows that int8 ran)."""
    arch = read_arch(default_model_path)
    model = load(default_model_path, arch, torch.float32, "gguf")
    agree, total, diffs = 0, 0, []
    for want, got in zip(reference_logits, teacher_forced(model, sequences, True), strict=True):
        agree += int((want.argmax(-1) == got.argmax(-1)).sum())
        total += want.shape[0]
        diffs.append((want - got).abs().mean())
    dlogit = torch.stack(diffs).mean().item()
    print(f"\nint8 activations, float32 (decode): top-1 agreement {agree}/{total} = "
          f"{agree / total:.2%}, mean |dlogit| {dlogit:.4f}")
    assert agree / total >= 0.96 and dlogit > 0.01
