"""Logits controls through the real engine (vLLM's SamplingParams): logit_bias, allowed_token_ids,
bad_words, truncate_prompt_tokens and detokenize=False, alone and with penalties, logprobs and
structured outputs. One tiny-model LLM for the module."""

from __future__ import annotations

from collections import Counter

import pytest

from shardserve import LLM, SamplingParams
from shardserve.sampling_params import StructuredOutputsParams

PROMPTS = ["The quick brown fox", "Hello, world!", "def add(a, b):", "Tensor parallel"]


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    engine = LLM(str(tiny_llama_dir), dtype="float32", max_model_len=128, seed=0)
    yield engine
    engine.shutdown()


def run(llm: LLM, prompts, **params) -> list:
    return llm.generate(prompts, SamplingParams(**params), use_tqdm=False)


def token_ids(outputs) -> list[list[int]]:
    return [c.token_ids for out in outputs for c in out.outputs]


def test_logit_bias_forces_a_token_greedy_and_random(llm):
    greedy = token_ids(run(llm, PROMPTS, temperature=0, max_tokens=6, ignore_eos=True))
    target = next(t for t in range(10, 300) if all(t not in ids for ids in greedy))
    for extra in ({"temperature": 0}, {"temperature": 1.0, "seed": 3},
                  {"temperature": 1.0, "seed": 3, "repetition_penalty": 1.5,
                   "presence_penalty": 1.0, "top_p": 0.9, "top_k": 20, "min_p": 0.05}):
        got = token_ids(run(llm, PROMPTS, max_tokens=6, ignore_eos=True,
                            logit_bias={target: 100.0}, **extra))
        assert got == [[target] * 6] * len(PROMPTS), extra


def test_logit_bias_keeps_raw_logprobs_and_minus_100_bans(llm):
    plain = run(llm, PROMPTS[:1], temperature=0, max_tokens=4, ignore_eos=True, logprobs=2)
    first = plain[0].outputs[0].token_ids[0]
    banned = run(llm, PROMPTS[:1], temperature=0, max_tokens=4, ignore_eos=True, logprobs=2,
                 logit_bias={first: -100.0})[0].outputs[0]
    assert banned.token_ids[0] != first
    # Logprobs are the model's own (vLLM's raw logprobs): the banned token is still listed.
    assert banned.logprobs[0][first].logprob == pytest.approx(
        plain[0].outputs[0].logprobs[0][first].logprob, abs=1e-5)


def test_allowed_token_ids_keeps_every_sample_in_the_set(llm):
    allowed = [17, 42, 99, 123, 250]
    outs = run(llm, [PROMPTS[0]], n=100, temperature=1.0, seed=11, max_tokens=5,
               ignore_eos=True, allowed_token_ids=allowed)
    seen = Counter(t for ids in token_ids(outs) for t in ids)
    assert len(token_ids(outs)) == 100 and set(seen) <= set(allowed)
    assert len(seen) >= 3, seen  # sampled, not collapsed onto one token


def _pair_in(ids: list[int], pair: list[int]) -> bool:
    return any(ids[i:i + len(pair)] == pair for i in range(len(ids) - len(pair) + 1))


def _word_from(llm: LLM, samples: list[list[int]]) -> tuple[str, list[list[int]]]:
    """A multi-token word the unbanned samples generate: two consecutive generated tokens
    whose text is tokenized back into exactly those two (with or without a leading space),
    the most frequent such pair. Returns the word and its tokenizations."""
    tok = llm.get_tokenizer()
    pairs = Counter((ids[i], ids[i + 1]) for ids in samples for i in range(len(ids) - 1))
    for (a, b), _ in pairs.most_common():
        word = tok.decode([a, b]).lstrip()
        variants = [tok.encode(w, add_special_tokens=False) for w in (word, " " + word)]
        if word.strip() and [a, b] in variants:
            return word, [v for v in variants if len(v) > 1]
    raise AssertionError("no two-token word among the samples")


def test_a_banned_multi_token_word_never_appears(llm):
    params = dict(n=100, temperature=1.0, seed=5, max_tokens=8, ignore_eos=True)
    free = token_ids(run(llm, [PROMPTS[1]], **params))
    word, sequences = _word_from(llm, free)
    assert any(_pair_in(ids, seq) for ids in free for seq in sequences)  # the test can fail
    banned = token_ids(run(llm, [PROMPTS[1]], bad_words=[word], **params))
    assert len(banned) == 100
    for ids in banned:
        assert not any(_pair_in(ids, seq) for seq in sequences), (word, ids)
    # Samples that never began the word are untouched (the ban is positional, not global).
    untouched = [i for i, ids in enumerate(free) if sequences[0][0] not in ids
                 and sequences[-1][0] not in ids]
    assert untouched and all(banned[i] == free[i] for i in untouched)


def test_a_single_token_bad_word_is_banned_everywhere(llm):
    tok = llm.get_tokenizer()
    params = dict(temperature=0, max_tokens=8, ignore_eos=True)
    free = token_ids(run(llm, PROMPTS, **params))

    def single(t: int) -> bool:
        word = tok.decode([t]).lstrip()
        return bool(word) and any(tok.encode(w, add_special_tokens=False) == [t]
                                  for w in (word, " " + word))

    target = Counter(t for ids in free for t in ids if single(t)).most_common(1)[0][0]
    banned = token_ids(run(llm, PROMPTS, bad_words=[tok.decode([target])], **params))
    assert all(target not in ids for ids in banned)


def test_logits_controls_compose_with_structured_outputs(llm):
    tok = llm.get_tokenizer()
    choices = ["quick", "lazy"]
    spec = StructuredOutputsParams(choice=choices)
    plain = run(llm, PROMPTS[:1], temperature=0, max_tokens=8, structured_outputs=spec)
    other = next(c for c in choices if c != plain[0].outputs[0].text)
    # A +100 bias on the other word's first token: the grammar allows it, and after it only
    # that word can follow; on a token the grammar forbids, the bias changes nothing.
    first = tok.encode(other, add_special_tokens=False)[0]
    for extra in ({"temperature": 0}, {"temperature": 1.0, "seed": 4}):
        got = run(llm, PROMPTS[:1], max_tokens=8, structured_outputs=spec,
                  logit_bias={first: 100.0}, **extra)
        assert got[0].outputs[0].text == other
    outside = tok.encode("fox", add_special_tokens=False)[0]
    got = run(llm, PROMPTS[:1], temperature=0, max_tokens=8, structured_outputs=spec,
              logit_bias={outside: 100.0}, allowed_token_ids=list(range(3, 300)))
    assert got[0].outputs[0].text in choices


def test_truncate_prompt_tokens_keeps_the_last_k(llm):
    ids = llm.get_tokenizer().encode(" ".join(PROMPTS))
    assert len(ids) > 8
    want = run(llm, [ids[-6:]], temperature=0, max_tokens=5)[0]
    got = run(llm, [ids], temperature=0, max_tokens=5, truncate_prompt_tokens=6)[0]
    assert got.prompt_token_ids == ids[-6:]
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    text = run(llm, [" ".join(PROMPTS)], temperature=0, max_tokens=5, truncate_prompt_tokens=6)
    assert text[0].outputs[0].token_ids == want.outputs[0].token_ids
    # Longer than max_model_len, kept to its last 100 tokens: served instead of refused.
    long = run(llm, [(ids * 30)[:200]], temperature=0, max_tokens=2, truncate_prompt_tokens=100)
    assert len(long[0].prompt_token_ids) == 100


def test_detokenize_false_gives_the_same_ids_and_no_text(llm):
    common = dict(temperature=1.0, seed=9, max_tokens=8, logprobs=1, prompt_logprobs=1)
    with_text = run(llm, PROMPTS, **common)
    ids_only = run(llm, PROMPTS, detokenize=False, **common)
    assert token_ids(ids_only) == token_ids(with_text)
    assert all(c.text == "" for out in ids_only for c in out.outputs)
    assert any(c.text for out in with_text for c in out.outputs)
    entry = ids_only[0].outputs[0].logprobs[0]
    assert all(lp.decoded_token is None for lp in entry.values())
    assert all(lp.decoded_token is None for lp in ids_only[0].prompt_logprobs[1].values())


@pytest.mark.parametrize(("params", "words"), [
    ({"logit_bias": {10**6: 1.0}}, ["logit_bias", "1000000", "vocab size"]),
    ({"logit_bias": {5: 150.0}}, ["logit_bias[5]", "[-100, 100]", "150"]),
    ({"allowed_token_ids": []}, ["allowed_token_ids", "empty"]),
    ({"allowed_token_ids": [3, 99999]}, ["allowed_token_ids", "99999", "vocab size"]),
    ({"bad_words": ["ok", ""]}, ["bad_words", "''"]),
    ({"truncate_prompt_tokens": 0}, ["truncate_prompt_tokens", ">= 1", "-1", "got 0"]),
    ({"detokenize": False, "stop": ["x"]}, ["detokenize", "stop", "stop_token_ids"]),
])
def test_errors_name_the_bad_value(llm, params, words):
    with pytest.raises(ValueError) as info:
        llm.generate(PROMPTS[:1], SamplingParams(max_tokens=2, **params), use_tqdm=False)
    assert all(w in str(info.value) for w in words), str(info.value)
