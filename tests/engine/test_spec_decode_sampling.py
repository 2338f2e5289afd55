"""Speculative decoding with sampling, through the real engine on a tiny model: the distribution
of what is sampled is unchanged, a deliberately wrong acceptance rule is caught, and seeded
requests (penalties, truncation, logits controls, logprobs) give exactly their tokens without
speculation (model/rejection_sampler.py: the rule draws through the position's own generator).

The model is conftest's echo model (a token mostly predicts itself): n-gram drafts of a repeated
token are accepted about half of the time, the regime where a wrong rule shows. One engine with
n-gram speculation serves every run; `scheduler.spec.k = 0` (no drafts verified) is the engine
without speculation.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest

from shardserve import LLM, SamplingParams
from shardserve.model import rejection_sampler

ECHO = 66  # p(66 | 66 ...) = 0.50 on the echo model: the prompt repeats it
PROMPT = [ECHO] * 8
DRAWS = 20_000
K = 2  # first verify step (max_tokens=4): drafts at positions 2 and 3, its bonus at 4
# Two-sample chi-square over the joint first 3 tokens (bins with >= 10 draws in both samples
# together; the rest pooled into one): fail at a p-value below 1e-3 (z = 3.09).
Z_CRITICAL = 3.09


@pytest.fixture(scope="module")
def engine(echo_model):
    llm = LLM(str(echo_model), dtype="float32", max_model_len=256, async_scheduling=False,
              max_num_seqs=1024, max_num_batched_tokens=8192,
              speculative_config={"method": "ngram", "num_speculative_tokens": K,
                                  "prompt_lookup_min": 1, "prompt_lookup_max": 2,
                                  "max_batch_for_speculation": 4096, "max_verify_rows": 0,
                                  "min_acceptance_rate": 0.0})
    yield llm
    llm.shutdown()


def _draws(llm: LLM, n: int, k: int, seeded: bool = False) -> list[tuple[int, ...]]:
    """The first 3 tokens of n requests (max_tokens=4: the first verify step's drafts cover
    positions 2 and 3). Unseeded requests draw from the engine's generator (seeded by the
    engine's seed, so the run reproduces): one batched draw a step, where a seeded request
    costs a generator of its own per position."""
    llm.engine.core.scheduler.spec.k = k
    params = [SamplingParams(max_tokens=4, temperature=1.0, top_p=0.9, ignore_eos=True,
                             seed=s if seeded else None, detokenize=False) for s in range(n)]
    outs = llm.generate([{"prompt_token_ids": PROMPT}] * n, params, use_tqdm=False)
    return [tuple(o.outputs[0].token_ids[:3]) for o in outs]


def _binned(a: Counter, b: Counter) -> list[tuple[int, int]]:
    """(count in a, count in b) per bin: outcomes with >= 10 draws in both together, and one
    bin pooling the rest."""
    bins, pooled = [], [0, 0]
    for key in set(a) | set(b):
        if a[key] + b[key] >= 10:
            bins.append((a[key], b[key]))
        else:
            pooled = [pooled[0] + a[key], pooled[1] + b[key]]
    return bins + ([tuple(pooled)] if sum(pooled) else [])


def _chi_square_z(bins: list[tuple[int, int]]) -> float:
    """The equal-size two-sample chi-square statistic as a standard normal deviate
    (Wilson-Hilferty's cube-root approximation)."""
    stat = sum((x - y) ** 2 / (x + y) for x, y in bins)
    df = len(bins) - 1
    c = 2 / (9 * df)
    return ((stat / df) ** (1 / 3) - (1 - c)) / math.sqrt(c)


@pytest.fixture(scope="module")
def without_speculation(engine) -> list[tuple[int, ...]]:
    return _draws(engine, DRAWS, k=0)


# The wrong rule fails by far (z ~ 80 at 20,000 draws): 4,000 keep the suite short, and a test
# that fails with fewer draws fails with more (z grows with the sample for a real difference).
@pytest.mark.parametrize(("rule", "draws"), [("exact", DRAWS), ("always_accept", 4_000)])
def test_first_three_tokens_distribution(engine, without_speculation, rule, draws, monkeypatch):
    """20,000 draws (temperature 1, top-p 0.9) with speculation against 20,000 without: the
    same distribution at p >= 1e-3; accepting every draft fails the same test."""
    if rule == "always_accept":
        monkeypatch.setattr(rejection_sampler, "_accept_rule", lambda drawn, drafts: len(drafts))
    stats = engine.engine.core.scheduler.spec.stats
    before = (stats.num_draft_tokens, stats.num_accepted_tokens)
    with_spec = _draws(engine, draws, k=K)
    drafted, accepted = (stats.num_draft_tokens - before[0], stats.num_accepted_tokens - before[1])
    assert drafted > draws // 2 and accepted > drafted // 5  # drafts really verified
    bins = _binned(Counter(without_speculation[:draws]), Counter(with_spec))
    z = _chi_square_z(bins)
    tv = 0.5 * sum(abs(x - y) for x, y in bins) / draws  # over the same bins
    print(f"rule {rule}: {len(bins)} bins, chi-square z {z:.2f}, TV {tv:.4f}, "
          f"{accepted}/{drafted} drafts accepted")
    assert (z < Z_CRITICAL) == (rule == "exact"), (z, tv)


def _controls(tok) -> list[dict]:
    """Sampling options whose effect depends on the position or the output so far."""
    echo_text = tok.decode([ECHO])
    return [dict(temperature=0.8, top_k=5), dict(temperature=1.0, min_p=0.05),
            dict(temperature=1.0, repetition_penalty=1.3, frequency_penalty=0.4,
                 presence_penalty=0.3),
            dict(temperature=0.0, repetition_penalty=1.2), dict(temperature=0.0),
            dict(temperature=1.0, logit_bias={ECHO: 1.5}),
            dict(temperature=1.0, allowed_token_ids=[ECHO, 5, 6, 7, 8]),
            dict(temperature=1.0, min_tokens=4, stop_token_ids=[ECHO]),
            dict(temperature=1.0, bad_words=[echo_text]), dict(temperature=1.0, top_p=0.5)]


def _outputs(llm: LLM, k: int) -> list[tuple]:
    llm.engine.core.scheduler.spec.k = k
    controls = _controls(llm.get_tokenizer())
    params = [SamplingParams(max_tokens=10, seed=s, logprobs=2 if s % 2 else None,
                             ignore_eos=True, **controls[s % len(controls)])
              for s in range(200)]
    outs = llm.generate([{"prompt_token_ids": PROMPT}] * len(params), params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason, o.outputs[0].logprobs)
            for o in outs]


def _same_logprobs(a: list | None, b: list | None) -> bool:
    """Equal entries (tokens and ranks), values within float32 noise: a verify step computes
    a position's logits among others (a prefill-shaped attention), not alone."""
    if a is None or b is None:
        return a is b
    return len(a) == len(b) and all(
        x.keys() == y.keys() and all(x[t].rank == y[t].rank
                                     and math.isclose(x[t].logprob, y[t].logprob, abs_tol=1e-4)
                                     for t in x) for x, y in zip(a, b, strict=True))


def test_seeded_requests_sample_their_tokens_without_speculation(engine):
    """Each position is sampled with the drafts before it as its output so far, and a seeded
    request's draw comes from a generator seeded by (seed, position) alone: with speculation
    a seeded request samples the very tokens (and logprobs) it samples without, under
    truncation, penalties, logits controls, min_tokens and bad words."""
    stats = engine.engine.core.scheduler.spec.stats
    accepted = stats.num_accepted_tokens
    with_spec, without = _outputs(engine, k=K), _outputs(engine, k=0)
    assert [o[:2] for o in with_spec] == [o[:2] for o in without]
    assert all(_same_logprobs(a[2], b[2]) for a, b in zip(with_spec, without, strict=True))
    assert stats.num_accepted_tokens > accepted + 100
    assert _draws(engine, 300, k=K, seeded=True) == _draws(engine, 300, k=0, seeded=True)
