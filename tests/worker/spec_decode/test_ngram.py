"""Prompt lookup: the longest recurring n-gram within [min, max], its earliest occurrence, and the
draft length cap (shardserve/worker/spec_decode/ngram.py)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from shardserve.worker.spec_decode.ngram import NgramProposer, cap_draft_len


def reference(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """vLLM's rule spelled out: longest n first, then the earliest earlier occurrence."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = tokens[-n:]
        for start in range(len(tokens) - n):  # occurrences ending before the last token
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


def test_longest_match_within_the_bounds_wins():
    tokens = [2, 3, 40, 1, 2, 3, 50, 1, 2, 3]
    # "1 2 3" (length 3) recurs, followed by 50; "2 3" first occurs followed by 40.
    assert NgramProposer(2, 3, 3).propose("r", tokens, 3) == [50, 1, 2]
    assert NgramProposer(2, 2, 3).propose("r", tokens, 3) == [40, 1, 2]
    assert NgramProposer(4, 5, 3).propose("r", tokens, 3) == []  # no 4-gram recurs


def test_earliest_occurrence_of_the_longest_match():
    tokens = [1, 2, 5, 1, 2, 6, 1, 2]
    assert NgramProposer(2, 2, 2).propose("r", tokens, 2) == [5, 1]


def test_no_match_and_short_inputs_give_nothing():
    proposer = NgramProposer(2, 4, 3)
    assert proposer.propose("r", [5, 6, 7, 8, 9], 3) == []
    assert proposer.propose("r", [3, 4, 3], 3) == []  # only a 1-gram recurs, min is 2
    assert proposer.propose("r", [4], 3) == []
    assert proposer.propose("r", [1, 2, 1, 2], 0) == []


def test_draft_stops_where_the_sequence_ends_and_may_overlap_the_suffix():
    assert NgramProposer(2, 2, 5).propose("r", [1, 2, 3, 1, 2], 5) == [3, 1, 2]
    assert NgramProposer(1, 3, 4).propose("r", [7, 7, 7, 7, 7], 4) == [7, 7]  # 3-gram at 0


def test_default_k_and_numpy_input():
    proposer = NgramProposer(1, 2, 2)
    tokens = [4, 5, 6, 4, 5]
    assert proposer.propose("r", tokens) == [6, 4]
    assert proposer.propose("r", np.array(tokens, dtype=np.int32)) == [6, 4]
    proposer.start("r", tokens)
    proposer.finish("r")  # stateless: nothing to do


def test_matches_the_reference_on_random_sequences():
    rng = random.Random(0)
    for case in range(300):
        tokens = [rng.randrange(3 if case % 2 else 6) for _ in range(rng.randrange(1, 40))]
        min_n = rng.randrange(1, 4)
        max_n = rng.randrange(min_n, 6)
        k = rng.randrange(1, 6)
        got = NgramProposer(min_n, max_n, k).propose("r", tokens, k)
        assert got == reference(tokens, min_n, max_n, k), (tokens, min_n, max_n, k)


def test_bad_bounds_refused():
    with pytest.raises(ValueError, match="min_n <= max_n"):
        NgramProposer(3, 2, 1)


@pytest.mark.parametrize(("k", "num_tokens", "max_model_len", "remaining", "expected"), [
    (5, 10, 100, 50, 5),    # room everywhere
    (5, 96, 100, 50, 3),    # 96 + 3 drafts + bonus = 100 = max_model_len
    (5, 99, 100, 50, 0),    # the next token is the last one: nothing to verify
    (5, 100, 100, 50, 0),
    (5, 10, 100, 3, 2),     # 3 more tokens allowed: 2 drafts + bonus
    (5, 10, 100, 1, 0),
    (0, 10, 100, 50, 0),
])
def test_cap_draft_len(k, num_tokens, max_model_len, remaining, expected):
    assert cap_draft_len(k, num_tokens, max_model_len, remaining) == expected
