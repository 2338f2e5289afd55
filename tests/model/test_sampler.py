from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from shardserve.model.sampler import (
    RequestSamplingState,
    Sampler,
    SamplingMetadata,
    apply_min_p,
    apply_penalties,
    apply_top_k_top_p,
    argmax_rows,
    seed_for_position,
)
from shardserve.sampling_params import SamplingParams

INF = float("inf")


def meta(params: list[SamplingParams], vocab: int, *, prompts: list[list[int]] | None = None,
         outputs: list[list[int]] | None = None, eos: tuple[int, ...] = (),
         generator: torch.Generator | None = None) -> SamplingMetadata:
    prompts = prompts or [[] for _ in params]
    outputs = outputs or [[] for _ in params]
    states = [RequestSamplingState(p, list(pr), list(out))
              for p, pr, out in zip(params, prompts, outputs, strict=True)]
    return SamplingMetadata.build(states, vocab, eos, generator=generator)


def sample(logits: torch.Tensor, params: list[SamplingParams], **kwargs: object) -> list[int]:
    mask = kwargs.pop("allowed_token_mask", None)
    out = Sampler()(logits, meta(params, logits.shape[1], **kwargs), allowed_token_mask=mask)
    return out.sampled_token_ids.tolist()


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def repeated(row: list[float], n: int) -> torch.Tensor:
    return torch.tensor(row, dtype=torch.float32).repeat(n, 1)


# --- greedy -----------------------------------------------------------------------------------

def test_greedy_is_argmax() -> None:
    logits = torch.randn(6, 40, generator=gen(0))
    got = sample(logits, [SamplingParams(temperature=0)] * 6)
    assert got == logits.argmax(dim=-1).tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_rows_is_torchs_argmax(dtype: torch.dtype) -> None:
    """float32 on CPU goes through numpy: the same first maximal index as torch's, with ties,
    a NaN (which torch takes as the maximum), -inf rows and strided rows."""
    logits = torch.randn(5, 300, generator=gen(3))
    logits[0, [7, 9, 200]] = 50.0
    logits[1, 11] = float("nan")
    logits[2] = float("-inf")
    logits = logits.to(dtype)
    for x in (logits, logits[:, ::3], logits[::2]):
        got = argmax_rows(x)
        assert got.dtype == torch.int64 and torch.equal(got, x.argmax(dim=-1))


def test_greedy_ties_break_to_lowest_id_every_time() -> None:
    logits = repeated([1.0, 3.0, 3.0, 0.0, 3.0], 4)
    for _ in range(3):
        assert sample(logits, [SamplingParams(temperature=0)] * 4) == [1, 1, 1, 1]


def test_greedy_with_penalties_changes_argmax() -> None:
    logits = repeated([2.0, 1.9, 0.0, -1.0], 3)
    params = [
        SamplingParams(temperature=0, repetition_penalty=1.2),  # 2.0 / 1.2 = 1.67 < 1.9
        SamplingParams(temperature=0, frequency_penalty=0.1),  # 2.0 - 0.2 = 1.8 < 1.9
        SamplingParams(temperature=0),  # no penalty: unchanged
    ]
    assert sample(logits, params, outputs=[[0], [0, 0], [0]]) == [1, 1, 0]
    # Repetition also counts prompt tokens; presence only output tokens.
    params = [SamplingParams(temperature=0, repetition_penalty=1.2),
              SamplingParams(temperature=0, presence_penalty=0.2)]
    assert sample(logits[:2], params, prompts=[[0], [0]]) == [1, 0]


def test_mixed_greedy_and_random_rows() -> None:
    logits = torch.randn(5, 30, generator=gen(1))
    params = [SamplingParams(temperature=0), SamplingParams(seed=3), SamplingParams(temperature=0),
              SamplingParams(), SamplingParams(temperature=0)]
    got = sample(logits, params, generator=gen(5))
    assert [got[i] for i in (0, 2, 4)] == logits[[0, 2, 4]].argmax(dim=-1).tolist()


# --- top-k / top-p / min-p --------------------------------------------------------------------

def test_top_k_support_is_exactly_top_k() -> None:
    row = [0.1, 0.7, 0.0, 0.6, 0.2, 0.5, 0.3, 0.4]  # top-3: ids 1, 3, 5
    n = 300
    params = [SamplingParams(top_k=3, seed=s) for s in range(n)]
    assert set(sample(repeated(row, n), params)) == {1, 3, 5}


def test_top_k_exactly_k_with_ties_and_per_row_k() -> None:
    logits = repeated([1.0, 1.0, 1.0, 1.0, 0.0], 3)
    kept = apply_top_k_top_p(logits.clone(), torch.tensor([2, 5, 1]), None).isfinite()
    assert kept.sum(dim=-1).tolist() == [2, 5, 1]
    assert kept[0].tolist() == [True, True, False, False, False]  # stable: lowest ids win ties


def _probs_logits(probs: list[float]) -> torch.Tensor:
    return torch.tensor([math.log(p) for p in probs], dtype=torch.float32)


def test_top_p_keeps_smallest_set_reaching_top_p() -> None:
    # Probabilities 0.5, 0.3, 0.15, 0.05 placed out of order.
    row = _probs_logits([0.15, 0.5, 0.05, 0.3])
    cases = {
        1e-7: {1},  # at least one token is always kept
        0.3: {1},  # the top token alone already reaches 0.3
        0.5: {1},  # boundary: 0.5 reaches 0.5 exactly
        0.51: {1, 3},
        0.8: {1, 3},  # boundary: 0.5 + 0.3 reaches 0.8 exactly
        0.81: {0, 1, 3},
        0.95: {0, 1, 3},  # boundary
        0.96: {0, 1, 2, 3},
        1.0: {0, 1, 2, 3},
    }
    top_p = torch.tensor(list(cases), dtype=torch.float32)
    kept = apply_top_k_top_p(row.repeat(len(cases), 1), None, top_p).isfinite()
    for i, expected in enumerate(cases.values()):
        assert set(kept[i].nonzero().flatten().tolist()) == expected, list(cases)[i]


def test_top_p_sampling_support() -> None:
    row = _probs_logits([0.15, 0.5, 0.05, 0.3]).tolist()
    n = 300
    params = [SamplingParams(top_p=0.8, seed=s) for s in range(n)]
    assert set(sample(repeated(row, n), params)) == {1, 3}


def test_top_k_then_top_p_renormalises() -> None:
    # After top-k=2 the survivors have probs 0.5/0.8 and 0.3/0.8: top_p=0.6 keeps only the first.
    row = _probs_logits([0.5, 0.3, 0.2]).unsqueeze(0)
    kept = apply_top_k_top_p(row, torch.tensor([2]), torch.tensor([0.6])).isfinite()
    assert kept[0].tolist() == [True, False, False]


def test_min_p_keeps_tokens_above_fraction_of_max() -> None:
    row = _probs_logits([0.1, 0.4, 0.2, 0.3])
    min_p = torch.tensor([0.6, 0.4, 0.0, 1.0])  # thresholds 0.24, 0.16, 0, 0.4
    kept = apply_min_p(row.repeat(4, 1), min_p).isfinite()
    expected = [[0, 1, 0, 1], [0, 1, 1, 1], [1, 1, 1, 1], [0, 1, 0, 0]]
    assert kept.int().tolist() == expected
    n = 300
    params = [SamplingParams(min_p=0.6, seed=s) for s in range(n)]
    assert set(sample(row.repeat(n, 1), params)) == {1, 3}


# --- temperature ------------------------------------------------------------------------------

@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_matches_softmax_distribution(temperature: float) -> None:
    row = [2.0, 1.0, 0.0]
    n = 6000
    got = sample(repeated(row, n), [SamplingParams(temperature=temperature)] * n,
                 generator=gen(11))
    counts = Counter(got)
    expected = torch.softmax(torch.tensor(row) / temperature, dim=0).tolist()
    chi2 = sum((counts[i] - n * p) ** 2 / (n * p) for i, p in enumerate(expected))
    assert chi2 < 16.3, (counts, expected)  # df=2, p ~ 0.0003


def test_temperature_flattens_distribution() -> None:
    row, n = [2.0, 1.0, 0.0], 4000
    top_share = {}
    for t in (0.5, 1.0, 2.0):
        got = sample(repeated(row, n), [SamplingParams(temperature=t)] * n, generator=gen(3))
        top_share[t] = got.count(0) / n
    assert top_share[0.5] > top_share[1.0] > top_share[2.0]


# --- seeding ----------------------------------------------------------------------------------

def _seeded_sequence(seed: int, steps: int, batch_builder) -> list[int]:
    """Tokens a seeded row produces at output positions 0..steps-1 inside various batches."""
    tokens: list[int] = []
    for _ in range(steps):
        logits, params, row = batch_builder(SamplingParams(seed=seed))
        outputs = [[] for _ in params]
        outputs[row] = list(tokens)
        tokens.append(sample(logits, params, outputs=outputs, generator=gen(99))[row])
    return tokens


def test_same_seed_same_tokens_whatever_the_batch() -> None:
    vocab = 50
    base = torch.randn(vocab, generator=gen(2)) * 0.3

    def alone(p: SamplingParams):
        return base.unsqueeze(0), [p], 0

    def crowded(p: SamplingParams):
        others = [SamplingParams(temperature=0), SamplingParams(top_k=5, seed=1),
                  SamplingParams(temperature=1.5), SamplingParams(top_p=0.5)]
        params = others[:2] + [p] + others[2:]
        return base.repeat(5, 1), params, 2

    def greedy_neighbours(p: SamplingParams):  # exercises the mixed greedy/random path
        return base.repeat(3, 1), [SamplingParams(temperature=0), p,
                                   SamplingParams(temperature=0)], 1

    ref = _seeded_sequence(1234, 12, alone)
    assert _seeded_sequence(1234, 12, crowded) == ref
    assert _seeded_sequence(1234, 12, greedy_neighbours) == ref
    assert len(set(ref)) > 3  # the draws really vary by position
    assert _seeded_sequence(1235, 12, alone) != ref


def test_seed_for_position_is_pure_and_distinct() -> None:
    assert seed_for_position(7, 3) == seed_for_position(7, 3)
    seeds = {seed_for_position(s, i) for s in range(-3, 20) for i in range(20)}
    assert len(seeds) == 23 * 20
    assert all(0 <= s < 2**64 for s in seeds)


def test_unseeded_rows_reproduce_with_same_shared_generator() -> None:
    logits = torch.zeros(20, 50)
    params = [SamplingParams()] * 20
    first = sample(logits, params, generator=gen(123))
    assert sample(logits, params, generator=gen(123)) == first
    assert sample(logits, params, generator=gen(124)) != first


# --- min_tokens -------------------------------------------------------------------------------

def test_min_tokens_blocks_eos_and_stop_ids_until_reached() -> None:
    row = [10.0, 9.0, 1.0, 0.0]  # eos=0 most likely, then stop id 1
    p = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[1])
    logits = repeated(row, 1)
    assert sample(logits, [p], eos=(0,), outputs=[[3]]) == [2]
    assert sample(logits, [p], eos=(0,), outputs=[[3, 3]]) == [0]
    ignore = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[1], ignore_eos=True)
    assert sample(logits, [ignore], eos=(0,)) == [0]  # eos is an ordinary token here
    assert sample(repeated([0.0, 10.0, 1.0, 0.0], 1), [ignore], eos=(0,)) == [2]
    n = 200
    random = [SamplingParams(min_tokens=1, stop_token_ids=[1], seed=s) for s in range(n)]
    assert not {0, 1} & set(sample(repeated(row, n), random, eos=(0,)))


# --- penalties --------------------------------------------------------------------------------

def test_apply_penalties_exact_amounts() -> None:
    logits = torch.tensor([[1.0, 2.0, -1.0, 3.0, 0.5], [1.0, 2.0, -1.0, 3.0, 0.5]])
    params = [SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25),
              SamplingParams()]
    m = meta(params, 5, prompts=[[1], [1]], outputs=[[2, 2, 3], [2, 2, 3]])
    before = logits.clone()
    out = apply_penalties(logits, m)
    assert torch.equal(logits, before)  # pure
    expected_row0 = [
        1.0,  # unseen: untouched
        2.0 / 2.0,  # prompt only: repetition divides a positive logit
        -1.0 * 2.0 - 0.5 * 2 - 0.25,  # output x2: multiply negative, freq * 2, presence
        3.0 / 2.0 - 0.5 - 0.25,  # output x1
        0.5,
    ]
    torch.testing.assert_close(out[0], torch.tensor(expected_row0))
    torch.testing.assert_close(out[1], logits[1])


def test_presence_and_frequency_ignore_prompt_tokens() -> None:
    logits = torch.zeros(1, 4)
    m = meta([SamplingParams(frequency_penalty=1.0, presence_penalty=1.0)], 4,
             prompts=[[0, 0, 1]], outputs=[[1]])
    torch.testing.assert_close(apply_penalties(logits, m), torch.tensor([[0.0, -2.0, 0.0, 0.0]]))


# --- logprobs ---------------------------------------------------------------------------------

def test_logprobs_of_raw_logits_sorted_with_ranks() -> None:
    logits = torch.randn(3, 20, generator=gen(4)) * 2
    allowed = torch.ones(3, 20, dtype=torch.bool)
    allowed[0, logits[0].argmax()] = False  # forces a rank > 1 on a greedy row
    params = [SamplingParams(temperature=0, logprobs=5, repetition_penalty=1.5),
              SamplingParams(logprobs=2, seed=9), SamplingParams(seed=10)]
    out = Sampler()(logits, meta(params, 20, outputs=[[1, 2], [3], []]),
                    allowed_token_mask=allowed)
    raw = torch.log_softmax(logits, dim=-1)
    sampled = out.sampled_token_ids
    assert out.logprob_token_ids.shape == (3, 6) and out.logprobs.shape == (3, 6)
    assert out.logprob_token_ids.dtype == torch.int64 and out.logprobs.dtype == torch.float32
    assert torch.equal(out.logprob_token_ids[:, 0], sampled)
    torch.testing.assert_close(out.logprobs[:, 0], raw.gather(1, sampled[:, None]).squeeze(1))
    top_vals, top_ids = raw.topk(5, dim=-1)
    assert torch.equal(out.logprob_token_ids[:, 1:], top_ids)
    torch.testing.assert_close(out.logprobs[:, 1:], top_vals)
    assert (out.logprobs[:, 1:].diff(dim=-1) <= 0).all()
    order = raw.argsort(dim=-1, descending=True)
    expected_ranks = [order[i].tolist().index(sampled[i].item()) + 1 for i in range(3)]
    assert out.sampled_token_ranks.tolist() == expected_ranks
    assert expected_ranks[0] > 1


def test_no_logprobs_requested() -> None:
    out = Sampler()(torch.randn(2, 8), meta([SamplingParams(temperature=0)] * 2, 8))
    assert out.logprobs is None and out.logprob_token_ids is None
    assert out.sampled_token_ranks is None
    assert out.sampled_token_ids.dtype == torch.int64


def test_logprobs_zero_gives_only_sampled_token() -> None:
    out = Sampler()(torch.randn(2, 8), meta([SamplingParams(temperature=0, logprobs=0)] * 2, 8))
    assert out.logprobs.shape == (2, 1) and out.logprob_token_ids.shape == (2, 1)


# --- allowed-token mask -----------------------------------------------------------------------

def test_allowed_token_mask_forces_allowed_set() -> None:
    n, vocab = 200, 12
    logits = torch.randn(n, vocab, generator=gen(6))
    allowed = torch.zeros(n, vocab, dtype=torch.bool)
    allowed[:, [3, 7]] = True
    params = [SamplingParams(seed=s) for s in range(n - 1)] + [SamplingParams(temperature=0)]
    got = sample(logits, params, allowed_token_mask=allowed)
    assert set(got) == {3, 7}
    best = 3 if logits[-1, 3] >= logits[-1, 7] else 7
    assert got[-1] == best


def test_input_logits_not_modified_and_shape_checked() -> None:
    logits = torch.randn(2, 8)
    before = logits.clone()
    sample(logits, [SamplingParams(top_k=2, repetition_penalty=1.3), SamplingParams(top_p=0.5)],
           outputs=[[1], [2]])
    assert torch.equal(logits, before)
    with pytest.raises(ValueError, match="logits"):
        Sampler()(torch.randn(2, 9), meta([SamplingParams()] * 2, 8))
