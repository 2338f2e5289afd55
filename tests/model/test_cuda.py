"""The CUDA path the README describes ("Runs on CPUs (gloo) and CUDA GPUs (NCCL)"): greedy with
device="cuda" against HF transformers on the same GPU, and tensor parallelism over NCCL against
one GPU. Marked gpu: tests/conftest.py skips them where torch sees no CUDA device."""

from __future__ import annotations

import copy

import pytest
import torch

from shardserve import LLM, SamplingParams

pytestmark = pytest.mark.gpu

PROMPTS = ["The quick brown fox", "def add(a, b):", "Hello, world! How are", "Tensor parallel"]
DEFAULT_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
]
# A small KV cache: the default takes a fraction of the whole GPU, which an H100-class card
# spends seconds zeroing for nothing here.
CUDA = dict(device="cuda", max_model_len=256, kv_cache_memory_bytes=256 << 20)


def _generate(path, n: int, prompts: list[str], **options) -> tuple[list, list, list]:
    """Prompt ids, greedy token ids and the chosen tokens' logprobs; asserts every rank ran on
    its own GPU (and over NCCL), so a silent fall back to the CPU cannot pass."""
    llm = LLM(str(path) if path else None, **{**CUDA, **options})
    try:
        devices = llm.collective_rpc(
            lambda w: str(next(w.model_runner.model.parameters()).device)
        )
        assert devices == [f"cuda:{r}" for r in range(len(devices))], devices
        if len(devices) > 1:
            backends = llm.collective_rpc(lambda w: torch.distributed.get_backend())
            assert backends == ["nccl"] * len(devices)
        params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=1)
        outs = llm.generate(prompts, params, use_tqdm=False)
        tokens = [o.outputs[0].token_ids for o in outs]
        logprobs = [
            [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, ids, strict=True)]
            for o, ids in zip(outs, tokens, strict=True)
        ]
        return [o.prompt_token_ids for o in outs], tokens, logprobs
    finally:
        llm.shutdown()


def _hf_next_tokens(model, ids: list[int]) -> list[int]:
    """HF's argmax after every prefix of `ids` (one forward on the model's device)."""
    with torch.inference_mode():
        logits = model(torch.tensor([ids], device=model.device)).logits[0]
    return logits.float().argmax(-1).tolist()


def _agreement(prompt_ids: list[list[int]], outputs: list[list[int]], hf) -> int:
    """Tokens before each output's first divergence from HF's greedy (full recomputation): HF
    over prompt + our tokens agrees with ours up to the first argmax that is not our token."""
    agreed = 0
    for ids, got in zip(prompt_ids, outputs, strict=True):
        hf_next = _hf_next_tokens(hf, ids + got[:-1])[len(ids) - 1 :]
        agreed += next((i for i, (a, b) in enumerate(zip(got, hf_next, strict=True)) if a != b),
                       len(got))
    return agreed


def test_tiny_llama_greedy_on_cuda_matches_hf_on_cuda(tiny_llama_dir) -> None:
    import transformers

    n = 12
    prompt_ids, tokens, _ = _generate(tiny_llama_dir, n, PROMPTS, dtype="float32")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    assert _agreement(prompt_ids, tokens, hf.to("cuda").eval()) == n * len(PROMPTS)


@pytest.mark.slow
def test_default_model_on_cuda_matches_hf_on_cuda(hf_default_model, hf_default_model_bf16) -> None:
    """float32: greedy identical; dtype="auto" (bfloat16 on CUDA): within bf16's ties."""
    n, total = 24, 24 * len(DEFAULT_PROMPTS)
    prompt_ids, fp32, _ = _generate(None, n, DEFAULT_PROMPTS, dtype="float32")
    # Copies: the session's CPU models stay where the other tests expect them.
    assert _agreement(prompt_ids, fp32, copy.deepcopy(hf_default_model).to("cuda")) == total
    prompt_ids, bf16, _ = _generate(None, n, DEFAULT_PROMPTS)  # auto
    # As on CPU (tests/entrypoints/test_llm_oracle.py): bf16 ties flip with any rounding, so a
    # floor with room for an early divergence or two rather than equality.
    hf_bf16 = copy.deepcopy(hf_default_model_bf16).to("cuda")
    assert _agreement(prompt_ids, bf16, hf_bf16) >= 0.75 * total


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_tp2_over_nccl_equals_one_gpu(tiny_llama_dir) -> None:
    # TP=2 first: its workers start before this process holds a CUDA context (fork is fine).
    _, tp2_tokens, tp2_lp = _generate(
        tiny_llama_dir, 10, PROMPTS, dtype="float32", tensor_parallel_size=2,
        distributed_executor_backend="mp",
    )  # fmt: skip
    _, tp1_tokens, tp1_lp = _generate(tiny_llama_dir, 10, PROMPTS, dtype="float32")
    assert tp2_tokens == tp1_tokens
    # NCCL sums the row-parallel partial products in another order: float32 rounding only.
    torch.testing.assert_close(torch.tensor(tp2_lp), torch.tensor(tp1_lp), rtol=1e-4, atol=1e-4)
