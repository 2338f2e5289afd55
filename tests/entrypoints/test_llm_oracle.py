"""End-to-end correctness against HF transformers on the same weights (float32 greedy)."""

from __future__ import annotations

import pytest
import torch

from shardserve import LLM, SamplingParams

RAW_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
]
CHAT_PROMPTS = [
    "What is 2 + 2?",
    "Write a haiku about the sea.",
    "Name three fruits.",
    "Explain gravity in one sentence.",
]


def _hf_greedy_no_cache(model, prompt_ids: list[int], n: int) -> tuple[list[int], list[float]]:
    """Greedy decoding by full recomputation: the plainest possible oracle."""
    ids = list(prompt_ids)
    logprobs = []
    for _ in range(n):
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1].float()
        token = int(torch.argmax(logits))
        logprobs.append(float(torch.log_softmax(logits, -1)[token]))
        ids.append(token)
    return ids[len(prompt_ids) :], logprobs


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_qwen2_dir"])
def test_tiny_random_models_match_hf(fixture, request):
    import transformers

    folder = request.getfixturevalue(fixture)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    llm = LLM(str(folder), dtype="float32", max_model_len=256)
    try:
        tok = llm.get_tokenizer()
        prompts = ["The quick brown fox", "def add(a, b):", "Hello, world! How", "Tensor"]
        params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=1)
        outs = llm.generate(prompts, params, use_tqdm=False)
        for prompt, out in zip(prompts, outs, strict=True):
            ids = tok.encode(prompt)
            assert out.prompt_token_ids == ids
            want, want_lp = _hf_greedy_no_cache(hf, ids, 12)
            assert out.outputs[0].token_ids == want, prompt
            got_lp = [lp[t].logprob for lp, t in zip(out.outputs[0].logprobs, want, strict=True)]
            torch.testing.assert_close(
                torch.tensor(got_lp), torch.tensor(want_lp), rtol=1e-4, atol=1e-4
            )
    finally:
        llm.shutdown()


@pytest.mark.slow
def test_default_model_matches_hf_generate(hf_default_model):
    llm = LLM(dtype="float32", max_model_len=512)
    try:
        tok = llm.get_tokenizer()
        chat_ids = [
            tok.apply_chat_template(
                [{"role": "user", "content": p}], add_generation_prompt=True, return_dict=False
            )
            for p in CHAT_PROMPTS
        ]
        prompt_ids = [tok.encode(p) for p in RAW_PROMPTS] + [list(c) for c in chat_ids]
        params = SamplingParams(max_tokens=32, temperature=0)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompt_ids], params, use_tqdm=False)
        for ids, out in zip(prompt_ids, outs, strict=True):
            with torch.no_grad():
                ref = hf_default_model.generate(
                    torch.tensor([ids]), max_new_tokens=32, do_sample=False, eos_token_id=2
                )
            want = ref[0, len(ids) :].tolist()
            assert out.outputs[0].token_ids == want, tok.decode(ids)
    finally:
        llm.shutdown()
