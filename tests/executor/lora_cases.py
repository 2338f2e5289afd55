"""LoRA on every executor backend: an adapter made by peft for a tiny model, the uni engine's
outputs with it (the reference), and the check a backend's engine must pass: the adapter calls
reach every rank (Executor.add_lora / list_loras / pin_lora / remove_lora, the lists compared
across the ranks) and generation through the adapter equals uni's."""

from __future__ import annotations

from pathlib import Path

from shardserve import LLM, SamplingParams
from shardserve.lora.request import LoRARequest
from tests.lora_helpers import make_peft_adapter

LORA_OPTIONS = dict(enable_lora=True, max_lora_rank=8)


def tiny_adapter(model_dir: Path, folder: Path, lora_int_id: int = 1) -> LoRARequest:
    """A rank-8 adapter on all seven projections of the model in `model_dir`."""
    import torch
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    path = make_peft_adapter(hf.eval(), folder, rank=8, seed=lora_int_id, b_std=0.2)
    return LoRARequest(f"adapter{lora_int_id}", lora_int_id, str(path))


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def uni_lora_tokens(model_dir: Path, lora: LoRARequest, prompts: list,
                    params: SamplingParams | list[SamplingParams],
                    max_model_len: int = 256) -> list[list[int]]:
    """uni's outputs through the adapter, checked to differ from the base model's."""
    llm = LLM(str(model_dir), dtype="float32", max_model_len=max_model_len, **LORA_OPTIONS)
    try:
        base = _tokens(llm.generate(prompts, params, use_tqdm=False))
        got = _tokens(llm.generate(prompts, params, use_tqdm=False, lora_request=lora))
    finally:
        llm.shutdown()
    assert got != base, "the adapter changes nothing: the check could not fail"
    return got


def check_adapter_calls(llm: LLM, lora: LoRARequest, prompts: list,
                        params: SamplingParams | list[SamplingParams],
                        want: list[list[int]]) -> None:
    executor = llm.engine.core.executor
    ranks = executor.parallel_config.world_size
    lora_id = lora.lora_int_id
    assert llm.add_lora(lora) and not llm.add_lora(lora)
    assert executor.list_loras() == [lora_id]  # the same on every rank, or it raises
    assert llm.collective_rpc("list_loras") == [[lora_id]] * ranks
    assert _tokens(llm.generate(prompts, params, use_tqdm=False, lora_request=lora)) == want
    assert llm.pin_lora(lora_id) and llm.remove_lora(lora_id)
    assert executor.list_loras() == [] and not llm.remove_lora(lora_id)
