"""prompt_logprobs: for every prompt token after the first, its logprob given the tokens before
it, equal (within float32 tolerance) to HF transformers' teacher-forced forward on the same
weights, with the top-N alternatives and the actual token's rank; computed in the prefill's own
forward pass, also when the prompt is prefilled in several chunks and when a request is
preempted and recomputed."""

from __future__ import annotations

import pytest
import torch

from shardserve import LLM, SamplingParams

PROMPTS = ["The quick brown fox jumps over the lazy dog and keeps running far away",
           "def add(a, b): return a + b"]


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    """log_softmax of HF's logits at every position, per prompt, and the prompts' ids."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(tiny_llama_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir,
                                                              dtype=torch.float32).eval()
    out = []
    for prompt in PROMPTS:
        ids = tok.encode(prompt)
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0].float()
        out.append((ids, logits.log_softmax(-1)))
    return out


@pytest.mark.parametrize("options", [{}, {"max_num_batched_tokens": 5},
                                     {"num_blocks_override": 4, "max_num_seqs": 2}],
                         ids=["one-chunk", "chunked", "preempted"])
def test_prompt_logprobs_equal_a_teacher_forced_forward(tiny_llama_dir, reference, options):
    llm = LLM(str(tiny_llama_dir), dtype="float32", max_model_len=48, **options)
    try:
        params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                prompt_logprobs=3)
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        if "num_blocks_override" in options:
            assert llm.engine.core.scheduler.total_preemptions > 0
    finally:
        llm.shutdown()
    for out, (ids, ref) in zip(outs, reference, strict=True):
        assert out.prompt_token_ids == ids
        lps = out.prompt_logprobs
        assert lps is not None and len(lps) == len(ids) and lps[0] is None
        for p in range(1, len(ids)):
            entry = lps[p]
            actual = entry[ids[p]]
            assert actual.logprob == pytest.approx(ref[p - 1, ids[p]].item(), abs=1e-4)
            assert actual.rank == int((ref[p - 1] > ref[p - 1, ids[p]]).sum()) + 1
            top = ref[p - 1].topk(3).indices.tolist()
            assert set(top) <= set(entry), (p, top, entry)


def test_prompt_logprobs_are_validated(tiny_llama_dir):
    with pytest.raises(ValueError, match="prompt_logprobs must be in"):
        SamplingParams(prompt_logprobs=21)
