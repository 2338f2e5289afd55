"""The output rank's drafter (worker/spec_verify.py): proposals from each request's tokens kept
as a growing array, with the tokens a step emitted that the state does not hold yet (pipeline
stages), capped by max_model_len and max_tokens, none above the batch limit."""

from __future__ import annotations

from shardserve.config.speculative import SpeculativeConfig
from shardserve.model.sampler import RequestSamplingState
from shardserve.sampling_params import SamplingParams
from shardserve.worker.spec_verify import Drafter

NGRAM = SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_min=1,
                          prompt_lookup_max=2, max_batch_for_speculation=2)


def test_proposals_follow_the_tokens_as_they_grow():
    drafter = Drafter(NGRAM, max_model_len=512)
    state = RequestSamplingState(SamplingParams(max_tokens=500), [1, 2, 3, 4, 1], [])
    drafter.start("r", state.prompt_token_ids)
    assert drafter.propose([("r", state, [])], 1) == {"r": [2, 3, 4]}
    state.output_token_ids += [2, 3, 4, 1, 2] * 20  # grows past the initial capacity
    assert drafter.propose([("r", state, [])], 1) == {"r": [3, 4, 1]}
    # Stages: tokens of this step not in the state yet, then the state catches up.
    assert drafter.propose([("r", state, [9, 9])], 1) == {"r": [9]}
    state.output_token_ids += [9, 9]
    assert drafter.propose([("r", state, [])], 1) == {"r": [9]}
    assert drafter.propose([("r", state, [1])], 1) == {"r": [2, 3, 4]}


def test_caps_and_batch_limit():
    drafter = Drafter(NGRAM, max_model_len=9)
    state = RequestSamplingState(SamplingParams(max_tokens=50), [1, 2, 3, 1], [2])
    drafter.start("r", state.prompt_token_ids)
    assert drafter.propose([("r", state, [])], 1) == {"r": [3, 1, 2]}
    assert drafter.propose([("r", state, [])], 3) == {}  # 3 running > 2
    state.output_token_ids += [3, 1]  # 7 tokens: one more draft + the bonus token fit in 9
    assert drafter.propose([("r", state, [])], 1) == {"r": [2]}
    short = RequestSamplingState(SamplingParams(max_tokens=3), [1, 2, 3, 1], [2])
    drafter.start("s", short.prompt_token_ids)
    assert drafter.propose([("s", short, [])], 1) == {"s": [3]}  # 1 draft + bonus = max_tokens


def test_the_suffix_index_sees_tokens_of_steps_it_proposed_nothing_for():
    """Above the batch limit nothing is proposed and the suffix index is not called; it takes
    the tokens it missed at finish: a finished request's whole output reaches the global store
    for later requests."""
    suffix = SpeculativeConfig(method="suffix", num_speculative_tokens=4,
                               max_batch_for_speculation=2)
    drafter = Drafter(suffix, max_model_len=512)
    state = RequestSamplingState(SamplingParams(max_tokens=50), [1, 2], [])
    drafter.start("a", state.prompt_token_ids)
    for token in (5, 6, 7, 8, 9):
        state.output_token_ids.append(token)
        assert drafter.propose([("a", state, [])], 3) == {}  # 3 running > 2
    assert drafter.proposer._requests["a"][0].size == 2  # not called: the prompt only
    drafter.finish("a", state.output_token_ids)
    later = RequestSamplingState(SamplingParams(max_tokens=50), [5, 6, 7], [])
    drafter.start("b", later.prompt_token_ids)
    assert drafter.propose([("b", later, [])], 1) == {"b": [8, 9]}


def test_the_suffix_index_catches_up_at_its_next_proposal():
    """Steps above the batch limit skipped, the next proposal below it sees every token."""
    suffix = SpeculativeConfig(method="suffix", num_speculative_tokens=4,
                               max_batch_for_speculation=2)
    drafter = Drafter(suffix, max_model_len=512)
    state = RequestSamplingState(SamplingParams(max_tokens=50), [1, 2, 3, 4], [])
    drafter.start("a", state.prompt_token_ids)
    for token in (1, 2, 3, 4, 1, 2):
        state.output_token_ids.append(token)
        assert drafter.propose([("a", state, [])], 3) == {}
    assert drafter.propose([("a", state, [])], 1) == {"a": [3, 4, 1, 2]}
