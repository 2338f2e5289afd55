"""Suffix decoding (`method: "suffix"`): propose the most frequent continuation of the longest
recent context, from the request's own prompt and output and from recently finished requests'
outputs.

What it computes is a suffix trie of depth D (suffix_decoding_max_tree_depth) with counts: the
count of a node (a token string s) is the number of occurrences of s, its children are the
tokens that followed those occurrences. The trie is not stored node by node (in Python that
would be about D nodes of ~200 bytes per token); each proposal computes the few nodes it visits
from the stored token sequences instead, which gives the same counts:

  1. match: the positions where the last token occurs (found by one numpy comparison over the
     request's tokens, or by a bigram index over the global store) are filtered token by token
     backwards (`match_levels`); level L holds the occurrences of the last L tokens, i.e. the
     trie node of that context and its count.
  2. walk: from a level's occurrences, the most frequent next token is proposed while the
     product of the frequency shares along the draft (its estimated probability) stays >=
     suffix_decoding_min_token_prob; the occurrences that continue with it are the child node.
  3. choose: a draft from a context of L tokens has at most min(k, floor(factor * L), D - L)
     tokens (D bounds match + draft, as vLLM's option says). Each level is scored by its
     expected accepted length (the sum of the probabilities along its draft, as Arctic
     Inference scores drafts), longest context first; a shorter context is tried only while it
     could still score higher. The better of the request's and the global store's drafts wins.

Memory (the bound the options set): 8 bytes per token of each running request (prompt +
output); for the global store, 16 bytes per token (the token and its bigram chain link) plus a
dict entry per distinct bigram, for at most suffix_decoding_max_cached_requests finished
outputs. Evicted outputs are compacted away once they are half of the store, so it holds at
most about twice the live outputs' tokens. Nothing grows with the depth D.
Work per proposal: one comparison over the request's tokens, then O(D) numpy calls on at most
_MAX_CANDIDATES occurrences; a finished output costs a Python loop over its tokens.
"""

from __future__ import annotations

from array import array
from collections import deque

import numpy as np

from shardserve.worker.spec_decode.ngram import TokenIds, as_token_array, match_levels

_PAD = -1  # never a token id: matches cannot cross it, walks stop at it
# Bounds on the work of one proposal where a token recurs very often (a repeated character, a
# degenerate loop): the most recent occurrences matched, and those whose continuations are
# counted (the shares are then estimated from that sample).
_MAX_CANDIDATES = 1024
_MAX_GLOBAL_CANDIDATES = 256  # walked one by one along the bigram's chain
_MAX_COUNTED = 256
# Scores are sums of float products: a draft replaces another only when better by more than
# rounding, so equal scores keep the longer context (and the request's own tokens).
_EPS = 1e-9


class _TokenBuffer:
    """A growable int64 token array with a _PAD before the first token and after the last, so
    matches stop at both ends without bounds checks. Tokens live at data[1 : 1 + size]."""

    def __init__(self, capacity: int = 256) -> None:
        self.data = np.full(capacity + 2, _PAD, dtype=np.int64)
        self.size = 0

    def extend(self, tokens: np.ndarray) -> int:
        """Append; returns the data index of the first appended token."""
        start, end = 1 + self.size, 1 + self.size + tokens.shape[0]
        if end + 1 > self.data.shape[0]:  # keep a _PAD after the end
            grown = np.full(max(2 * self.data.shape[0], end + 1), _PAD, dtype=np.int64)
            grown[:start] = self.data[:start]
            self.data = grown
        self.data[start:end] = tokens
        self.size += tokens.shape[0]
        return start

    def tokens(self) -> np.ndarray:
        return self.data[1:1 + self.size]


class _GlobalStore:
    """Finished requests' outputs, oldest evicted first, in one buffer (outputs separated by
    _PAD), indexed by bigram: `head` maps a bigram to the latest data position of its second
    token and `prev[pos]` chains to the one before (ints only: no container per bigram for the
    garbage collector to scan). Chains run from newest to oldest, so a lookup stops at the
    first evicted position."""

    def __init__(self, max_requests: int) -> None:
        self.max_requests = max_requests
        self.buf = _TokenBuffer()
        self.segments: deque[tuple[int, int]] = deque()  # (start, end) data indexes
        self.head: dict[int, int] = {}
        self.prev = array("q", [-1])  # one entry per data index (the leading _PAD's first)
        self.live_tokens = 0

    def add(self, tokens: np.ndarray) -> None:
        """Store a finished output, evicting the oldest beyond max_requests."""
        if self.max_requests == 0 or tokens.shape[0] == 0:
            return
        self._append(tokens)
        while len(self.segments) > self.max_requests:
            start, end = self.segments.popleft()
            self.buf.data[start:end] = _PAD
            self.live_tokens -= end - start
        if self.buf.size > 2 * (self.live_tokens + len(self.segments)) + 1024:
            self._compact()

    def _append(self, tokens: np.ndarray) -> None:
        start = self.buf.extend(np.append(tokens, _PAD))  # the _PAD separates outputs
        keys = (tokens[:-1] << 32) | tokens[1:]  # ids < 2**31: one key per bigram
        head, chain = self.head, [-1]  # the first token continues no bigram of this output
        for pos, key in enumerate(keys.tolist(), start + 1):
            chain.append(head.get(key, -1))
            head[key] = pos
        chain.append(-1)  # the separating _PAD
        self.prev.extend(chain)
        self.segments.append((start, start + tokens.shape[0]))
        self.live_tokens += tokens.shape[0]

    def _compact(self) -> None:
        """Rebuild without the evicted outputs: amortized O(1) a token, since it runs only
        once they are half of the buffer."""
        live = [self.buf.data[start:end].copy() for start, end in self.segments]
        self.buf, self.segments, self.live_tokens = _TokenBuffer(), deque(), 0
        self.head, self.prev = {}, array("q", [-1])
        for tokens in live:
            self._append(tokens)

    def candidates(self, pattern: np.ndarray) -> np.ndarray:
        """Data positions (ascending) of the most recent occurrences of pattern's last two
        tokens, at most _MAX_GLOBAL_CANDIDATES."""
        if pattern.shape[0] < 2 or not self.segments:
            return np.empty(0, dtype=np.int64)
        pos = self.head.get((int(pattern[-2]) << 32) | int(pattern[-1]), -1)
        oldest, prev, found = self.segments[0][0], self.prev, []
        while pos >= oldest and len(found) < _MAX_GLOBAL_CANDIDATES:
            found.append(pos)
            pos = prev[pos]
        return np.array(found[::-1], dtype=np.int64)


def _walk(corpus: np.ndarray, ends: np.ndarray, limit: int,
          min_prob: float) -> tuple[list[int], float]:
    """The greedy draft from the occurrences `ends` (the trie node) and its score, the sum of
    the estimated probabilities of its prefixes (the expected number of accepted tokens)."""
    draft: list[int] = []
    prob, score = 1.0, 0.0
    ends = ends[-_MAX_COUNTED:]
    while len(draft) < limit:
        if ends.shape[0] == 1:  # one occurrence: each share is 1, copy what followed it
            nxt = corpus[int(ends[0]) + 1:int(ends[0]) + 1 + limit - len(draft)].tolist()
            copied = nxt[:nxt.index(_PAD)] if _PAD in nxt else nxt
            return draft + copied, score + prob * len(copied)
        nxt = corpus[ends + 1]
        found = _most_frequent(nxt)
        if found is None:
            break
        token, count = found
        prob *= count / ends.shape[0]  # occurrences that end here count too
        if prob < min_prob:
            break
        draft.append(token)
        score += prob
        ends = ends[nxt == token] + 1
    return draft, score


def _most_frequent(tokens: np.ndarray) -> tuple[int, int] | None:
    """The most frequent id among tokens other than _PAD (ties: the smallest) and its count."""
    valid = tokens[tokens != _PAD]
    if not valid.shape[0]:
        return None
    if (valid == valid[0]).all():  # the common case in repetitive text: no sort needed
        return int(valid[0]), valid.shape[0]
    values, counts = np.unique(valid, return_counts=True)
    best = int(np.argmax(counts))
    return int(values[best]), int(counts[best])


class SuffixProposer:
    """Suffix decoding over each request's tokens and a bounded store of finished outputs."""

    learns_from_every_token = True  # its index takes every token, drafts or not

    def __init__(self, k: int, max_tree_depth: int = 24, max_cached_requests: int = 1000,
                 max_spec_factor: float = 1.0, min_token_prob: float = 0.1) -> None:
        if max_tree_depth < 2:
            raise ValueError(f"max_tree_depth={max_tree_depth} must be >= 2 (context + draft)")
        self.k, self.depth = k, max_tree_depth
        self.factor, self.min_prob = max_spec_factor, min_token_prob
        self.global_store = _GlobalStore(max_cached_requests)
        self._requests: dict[str, tuple[_TokenBuffer, int]] = {}  # buffer, prompt length

    def start(self, req_id: str, prompt_ids: TokenIds) -> None:
        """Index a new request's prompt (again after a restart of the same id)."""
        buf = _TokenBuffer(max(256, len(prompt_ids) * 2))
        buf.extend(as_token_array(prompt_ids))
        self._requests[req_id] = (buf, buf.size)

    def finish(self, req_id: str) -> None:
        """Forget the request; its output (not its prompt) joins the global store."""
        state = self._requests.pop(req_id, None)
        if state is not None:
            buf, prompt_len = state
            self.global_store.add(buf.tokens()[prompt_len:].copy())

    def propose(self, req_id: str, token_ids: TokenIds, k: int | None = None) -> list[int]:
        """Up to k draft tokens continuing token_ids (the request's prompt + output so far:
        the tokens not yet seen are appended to its index first)."""
        k = self.k if k is None else k
        buf = self._sync(req_id, token_ids)
        n = buf.size
        if k <= 0 or n < 1:
            return []
        pattern = buf.data[max(1, n + 1 - (self.depth - 1)):n + 1]  # at most D - 1 tokens
        own = np.flatnonzero(buf.data[1:n] == pattern[-1])[-_MAX_CANDIDATES:] + 1  # earlier ones
        best = self._best(buf.data, own, pattern, k, min_len=1)
        store = self.global_store
        other = self._best(store.buf.data, store.candidates(pattern), pattern, k, min_len=2)
        return (other if other[1] > best[1] + _EPS else best)[0]

    def _sync(self, req_id: str, token_ids: TokenIds) -> _TokenBuffer:
        """The request's buffer, holding exactly token_ids: the new tail is appended. (A
        request proposed for without start() is indexed whole, its tokens all output.)"""
        if req_id not in self._requests:
            self.start(req_id, [])
        buf, prompt_len = self._requests[req_id]
        n, held = len(token_ids), buf.size
        if held > n or (held and buf.data[held] != int(token_ids[held - 1])):
            # Not a continuation of what it holds (the caller passes committed tokens, so
            # this is a restarted request): index it again.
            self.start(req_id, token_ids[:prompt_len])
            buf = self._requests[req_id][0]
        if n > buf.size:
            buf.extend(as_token_array(token_ids[buf.size:]))
        return buf

    def _best(self, corpus: np.ndarray, ends: np.ndarray, pattern: np.ndarray, k: int,
              min_len: int) -> tuple[list[int], float]:
        """The best-scoring draft over the matching context lengths >= min_len."""
        best: tuple[list[int], float] = ([], 0.0)
        if not ends.shape[0]:
            return best
        levels = match_levels(corpus, ends, pattern, pattern.shape[0])
        top = len(levels)
        while top >= min_len:
            if min(k, self.factor * top) <= best[1] + _EPS:
                break  # no context of <= top tokens allows a longer draft than best scored
            low = top  # lengths low..top with the same occurrences are one trie node
            while low > min_len and levels[low - 2].shape[0] == levels[top - 1].shape[0]:
                low -= 1
            room = self._room(low, top, k)
            if room > best[1] + _EPS:
                draft = _walk(corpus, levels[top - 1], room, self.min_prob)
                best = draft if draft[1] > best[1] + _EPS else best
            top = low - 1
        return best

    def _room(self, low: int, high: int, k: int) -> int:
        """The most draft tokens a context of low..high tokens allows: min(k, factor * L,
        D - L) is largest where factor * L meets D - L, or at an end of the range."""
        cross = self.depth / (1 + self.factor)
        lengths = {low, high, *(min(high, max(low, m)) for m in (int(cross), int(cross) + 1))}
        return max(min(k, int(self.factor * m + 1e-6), self.depth - m) for m in lengths)

    @property
    def num_cached_requests(self) -> int:
        return len(self.global_store.segments)

    @property
    def num_cached_tokens(self) -> int:
        return self.global_store.live_tokens
