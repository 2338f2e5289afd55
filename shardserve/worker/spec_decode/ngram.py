"""Prompt lookup (`method: "ngram"`): propose the tokens that followed the longest recent n-gram
the request has already seen.

The rule is vLLM's: among n in [prompt_lookup_min, prompt_lookup_max], the longest suffix of the
request's tokens that occurred earlier in them; among the occurrences of that length the
earliest; the draft is up to k tokens that followed it (fewer where the sequence ends; an
occurrence may overlap the suffix itself, so a run of one token proposes more of it).

The search is vectorized: one comparison of the whole sequence against its last token gives the
candidate end positions, then each further token of the suffix filters them (a handful of numpy
calls on a shrinking array; no Python loop over the sequence). `match_levels` is shared with the
suffix proposer.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

TokenIds = Sequence[int] | np.ndarray


def as_token_array(token_ids: TokenIds) -> np.ndarray:
    """A 1-D integer array of the ids (no copy when given one): numpy arrays are the fast
    input; a list of a few thousand ids costs a conversion of tens of microseconds."""
    if isinstance(token_ids, np.ndarray) and token_ids.dtype.kind in "iu":
        return token_ids.reshape(-1)
    return np.asarray(token_ids, dtype=np.int64).reshape(-1)


def match_levels(corpus: np.ndarray, ends: np.ndarray, pattern: np.ndarray,
                 max_len: int) -> list[np.ndarray]:
    """levels[i]: the sorted positions e of `ends` whose corpus[e - i .. e] equals the last
    i + 1 tokens of `pattern` (each level a subset of the one before; `ends` must already
    match pattern[-1] and be sorted). Stops at max_len tokens or when no position is left."""
    levels = [ends]
    limit = min(max_len, len(pattern))
    for j in range(1, limit):
        if ends.shape[0] == 1:  # one occurrence left: compare the rest in one slice
            return levels + [ends] * _common_tail(corpus, int(ends[0]) - j, pattern, j, limit)
        if ends[0] < j:  # a match cannot run back past the corpus's start
            ends = ends[ends >= j]
            if not ends.size:
                break
        ends = ends[corpus[ends - j] == pattern[-1 - j]]
        if not ends.size:
            break
        levels.append(ends)
    return levels


def _common_tail(corpus: np.ndarray, end: int, pattern: np.ndarray, j: int, limit: int) -> int:
    """How many of pattern[-1 - j], pattern[-2 - j], ... (at most limit - j) equal corpus[end],
    corpus[end - 1], ...: the matched tokens counted backwards from both ends."""
    span = min(limit - j, end + 1)
    if span <= 0:
        return 0
    same = corpus[end - span + 1:end + 1] == pattern[len(pattern) - j - span:len(pattern) - j]
    misses = np.flatnonzero(~same)
    return span if not misses.size else span - 1 - int(misses[-1])


def cap_draft_len(k: int, num_tokens: int, max_model_len: int, remaining_max_tokens: int) -> int:
    """The draft length a request may verify this step: at most k, and small enough that even
    with every draft accepted plus the bonus token (k + 1 new tokens) the request holds at most
    max_model_len tokens and produces at most its remaining max_tokens, exactly where the
    engine would have stopped it without speculation.

    num_tokens: the tokens the request holds before the step (prompt + output, counting a
    token still in flight); remaining_max_tokens: how many more it may produce
    (max_tokens - outputs so far). 0 means: propose nothing."""
    return max(0, min(k, max_model_len - num_tokens - 1, remaining_max_tokens - 1))


class NgramProposer:
    """The n-gram proposer; stateless, so start and finish do nothing."""

    learns_from_every_token = False  # stateless: each call searches the tokens it gets

    def __init__(self, min_n: int, max_n: int, k: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.min_n, self.max_n, self.k = min_n, max_n, k

    def start(self, req_id: str, prompt_ids: TokenIds) -> None:
        """Nothing to index: each proposal searches the tokens it is given."""

    def finish(self, req_id: str) -> None:
        """Nothing kept per request."""

    def propose(self, req_id: str, token_ids: TokenIds, k: int | None = None) -> list[int]:
        """Up to k (default: the configured k) draft tokens for the request whose tokens so
        far (prompt + output) are token_ids; [] when no n-gram of length >= min_n recurs."""
        k = self.k if k is None else k
        tokens = as_token_array(token_ids)
        n = tokens.shape[0]
        if k <= 0 or n <= self.min_n:  # an earlier occurrence needs min_n tokens before the end
            return []
        ends = np.flatnonzero(tokens[:-1] == tokens[-1])
        if not ends.size:
            return []
        levels = match_levels(tokens, ends, tokens[-self.max_n:], self.max_n)
        if len(levels) < self.min_n:
            return []
        start = int(levels[-1][0]) + 1  # earliest occurrence of the longest match
        return tokens[start:start + k].tolist()
