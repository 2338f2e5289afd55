"""The default model's GGUF blocks (Q4_1 projections, quantization="gguf") with a rank-16
adapter on all seven projections (made by peft on the model's HF form) against the same file
dequantized to float32 with the same adapter: teacher-forced top-1 over the 8 oracle prompts
(each followed by a fixed text to 48 positions, read in one prefill), >= 99% asserted. The
adapter must also move the quantized model's own top-1 (else a path that dropped it on the
quantized kernels would pass). Measured: 100% of 384, the adapter moving 34% of the
quantized model's own top-1 (pytest -s prints both)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lora_helpers import make_peft_adapter

from shardserve.config.lora import LoRAConfig
from shardserve.lora.request import LoRARequest
from shardserve.model import native_kernels
from shardserve.model.llama import LlamaForCausalLM
from shardserve.model.loader import iter_weights, load_tokenizer, read_arch
from shardserve.worker.lora_manager import LoRAManager
from tests.entrypoints.pp_oracle import CHAT_PROMPTS, RAW_PROMPTS
from tests.model.test_llama import PagedRunner

POSITIONS = 48
FILLER = (" The engine schedules requests, allocates KV cache blocks and samples the next "
          "token. Tensor parallel inference splits attention heads and MLP columns across "
          "workers, and every step reads the whole model once. A journey of a thousand miles "
          "begins with one step; the quick brown fox jumps over the lazy dog.")
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not native_kernels.compiler_available(), reason="no C compiler")]


def _model(path: Path, quantization: str) -> tuple[LlamaForCausalLM, LoRAManager]:
    model = LlamaForCausalLM(read_arch(path), torch.float32, quantization=quantization)
    model.load_weights(iter_weights(path, keep_quantized=quantization == "gguf"))
    return model.eval(), LoRAManager(model, LoRAConfig(max_lora_rank=16), torch.float32)


def _top1(model: LlamaForCausalLM, manager: LoRAManager, seqs: list[list[int]],
          req: LoRARequest | None) -> torch.Tensor:
    manager.prepare([req] * len(seqs), [len(s) for s in seqs])
    runner = PagedRunner(model, block_size=16, num_blocks=8 * len(seqs), check_last_rows=False)
    rows = runner.step([(str(i), s) for i, s in enumerate(seqs)])
    return torch.cat([r.argmax(-1) for r in rows])


def test_gguf_base_with_adapter_agrees_with_float(default_model_path: Path, hf_default_model,
                                                  tmp_path: Path) -> None:
    folder = make_peft_adapter(hf_default_model, tmp_path / "a", rank=16, seed=7)
    req = LoRARequest("a", 1, str(folder))
    tok = load_tokenizer(default_model_path)
    seqs = [tok.encode(p + FILLER)[:POSITIONS] for p in RAW_PROMPTS + CHAT_PROMPTS]
    assert all(len(s) == POSITIONS for s in seqs)
    quantized, q_manager = _model(default_model_path, "gguf")
    assert quantized.model.layers[0].mlp.down_proj.qweight is not None
    got = _top1(quantized, q_manager, seqs, req)
    base = _top1(quantized, q_manager, seqs, None)
    del quantized, q_manager
    reference, f_manager = _model(default_model_path, "none")
    want = _top1(reference, f_manager, seqs, req)
    rate = float((got == want).float().mean())
    moved = float((got != base).float().mean())
    print(f"\ngguf + adapter vs float32 + adapter: top-1 {rate:.2%} of {want.numel()}; the "
          f"adapter changes the quantized model's top-1 at {moved:.0%}")
    assert want.numel() == 8 * POSITIONS
    assert rate >= 0.99
    assert moved > 0.2
