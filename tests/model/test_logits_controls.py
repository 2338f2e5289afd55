"""The batched logits controls in the sampler: logit_bias, allowed_token_ids and bad_words
(token-id sequences banned where they would complete), row by row in one batch, with the
grammar mask, min_tokens, penalties and logprobs."""

from __future__ import annotations

import pickle

import pytest
import torch

from shardserve.model.logits_controls import LogitsControls
from shardserve.model.sampler import RequestSamplingState, Sampler, SamplingMetadata
from shardserve.sampling_params import SamplingParams

V = 12
INF = float("inf")


def states(params: list[SamplingParams], outputs: list[list[int]] | None = None
           ) -> list[RequestSamplingState]:
    outputs = outputs or [[] for _ in params]
    return [RequestSamplingState(p, [1, 2], list(o)) for p, o in zip(params, outputs,
                                                                    strict=True)]


def controlled(logits: torch.Tensor, params: list[SamplingParams],
               outputs: list[list[int]] | None = None) -> torch.Tensor:
    controls = LogitsControls.build(states(params, outputs))
    assert controls is not None
    return controls.apply(logits)


def test_no_control_builds_nothing() -> None:
    assert LogitsControls.build(states([SamplingParams(), SamplingParams(top_k=3)])) is None
    meta = SamplingMetadata.build(states([SamplingParams()]), V, ())
    assert meta.logits_controls is None


def test_each_row_gets_its_own_controls_and_the_input_is_untouched() -> None:
    logits = torch.zeros(4, V)
    before = logits.clone()
    params = [SamplingParams(logit_bias={3: 5.0, 7: -2.5}),
              SamplingParams(),
              SamplingParams(allowed_token_ids=[1, 4]),
              SamplingParams(allowed_token_ids=[2], logit_bias={2: 1.0, 5: 9.0})]
    out = controlled(logits, params)
    assert torch.equal(logits, before)
    want = torch.zeros(4, V)
    want[0, 3], want[0, 7] = 5.0, -2.5
    want[2] = -INF
    want[2, [1, 4]] = 0.0
    want[3] = -INF
    want[3, 2] = 1.0  # the bias of a token outside the allowed set stays -inf
    assert torch.equal(out, want)


def test_a_multi_token_word_is_banned_only_where_it_would_complete() -> None:
    words = [[5], [6, 7], [8, 9, 10]]
    params = [SamplingParams(bad_words_token_ids=words)] * 5
    outputs = [[], [6], [1, 6], [8, 9], [9, 9]]
    out = controlled(torch.zeros(5, V), params, outputs)
    banned = [set((row == -INF).nonzero().flatten().tolist()) for row in out]
    assert banned == [{5}, {5, 7}, {5, 7}, {5, 10}, {5}]


def test_sampler_applies_controls_after_the_grammar_mask_and_before_penalties() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0, 0.5, 0.0]] * 3)
    grammar = torch.tensor([[True, True, False, True, True, True]] * 3)
    params = [SamplingParams(temperature=0, logit_bias={2: 100.0}),  # forbidden by grammar
              SamplingParams(temperature=0, allowed_token_ids=[3, 4], repetition_penalty=4.0),
              SamplingParams(temperature=1.0, seed=1, logit_bias={4: 100.0}, logprobs=1)]
    meta = SamplingMetadata.build(
        [RequestSamplingState(p, [3], []) for p in params], 6, ())
    out = Sampler()(logits, meta, allowed_token_mask=grammar)
    # Row 1: 3 is seen in the prompt, so 2.0 / 4 = 0.5 ties 4's 0.5; argmax takes the first.
    assert out.sampled_token_ids.tolist() == [1, 3, 4]
    # Logprobs are the raw distribution's (vLLM's default), not the biased one.
    assert out.logprobs[2, 0].item() == pytest.approx(logits[2].log_softmax(-1)[4].item())


def test_min_tokens_and_bans_and_random_rows_together() -> None:
    logits = torch.zeros(64, V)
    params = [SamplingParams(temperature=1.0, seed=i, min_tokens=2, stop_token_ids=[0],
                             allowed_token_ids=[0, 1, 2], bad_words_token_ids=[[2]])
              for i in range(64)]
    meta = SamplingMetadata.build(states(params), V, (11,))
    assert set(Sampler()(logits, meta).sampled_token_ids.tolist()) == {1}


def test_params_with_controls_pickle() -> None:
    params = SamplingParams(logit_bias={3: 1.5}, allowed_token_ids=[4, 3],
                            bad_words=["no"], bad_words_token_ids=[[5, 6]],
                            truncate_prompt_tokens=4, detokenize=False)
    back = pickle.loads(pickle.dumps(params))
    assert back == params and back.allowed_token_ids == [3, 4]
