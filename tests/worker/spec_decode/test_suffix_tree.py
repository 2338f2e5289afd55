"""Suffix decoding: matches in the prompt, the request's own output and finished requests'
outputs; the probability floor, the spec factor and depth; the global store's bound; and the
same proposals as an explicit suffix trie with counts (shardserve/worker/spec_decode/
suffix_tree.py)."""

from __future__ import annotations

import random

from shardserve.worker.spec_decode.suffix_tree import SuffixProposer

EPS = 1e-9


def test_prompt_match_proposes_what_followed_in_the_prompt():
    proposer = SuffixProposer(k=5, max_tree_depth=8)
    prompt = [10, 11, 12, 13, 14, 15, 16]
    proposer.start("r", prompt)
    # 3 tokens of context matched: a draft of at most 3 (factor 1), 8 - 3 = 5 (depth).
    assert proposer.propose("r", prompt + [10, 11, 12], 5) == [13, 14, 15]
    assert proposer.propose("r", prompt + [10, 11, 12], 2) == [13, 14]  # k caps it


def test_own_output_is_indexed_incrementally():
    proposer = SuffixProposer(k=4, max_tree_depth=16)
    proposer.start("r", [1, 2])
    tokens = [1, 2]
    for token in [30, 31, 32, 33, 34, 35, 30, 31, 32]:
        tokens.append(token)
        draft = proposer.propose("r", tokens, 4)
    assert draft == [33, 34, 35]  # 3 tokens of context matched allow 3 (factor 1)
    assert proposer._requests["r"][0].size == len(tokens)


def test_finished_output_is_proposed_to_another_request_but_not_its_prompt():
    proposer = SuffixProposer(k=6, max_tree_depth=24)
    proposer.start("a", [90, 91, 92, 93, 94, 95])
    proposer.propose("a", [90, 91, 92, 93, 94, 95, 50, 51, 52, 53, 54, 55, 56, 57], 6)
    proposer.finish("a")
    assert proposer.num_cached_requests == 1 and proposer.num_cached_tokens == 8
    proposer.start("b", [7, 8])
    assert proposer.propose("b", [7, 8, 50, 51, 52, 53], 6) == [54, 55, 56, 57]
    assert proposer.propose("b", [7, 8, 90, 91, 92, 93], 6) == []  # a's prompt is not kept


def test_min_token_prob_and_spec_factor():
    # After "1 2": 3 twice, 4 once (share 2/3); after "1 2 3": 8 and 7 once each (1/2).
    tokens = [9, 1, 2, 3, 8, 1, 2, 3, 7, 1, 2, 4, 6, 1, 2]

    def draft(**options):
        proposer = SuffixProposer(k=4, max_tree_depth=24, **options)
        proposer.start("r", tokens)
        return proposer.propose("r", tokens, 4)

    assert draft(min_token_prob=0.1) == [3, 7]  # 2 tokens: 2 of context matched; tie: 7 < 8
    assert draft(min_token_prob=0.5) == [3]  # 2/3 * 1/2 = 1/3 < 0.5
    assert draft(min_token_prob=0.7) == []  # 2/3 < 0.7
    assert draft(min_token_prob=0.1, max_spec_factor=0.5) == [3]  # 0.5 * 2 = 1 token


def test_depth_bounds_context_plus_draft():
    prompt = list(range(100, 130))
    tokens = prompt + list(range(100, 110))  # copying the prompt: 10 tokens of context
    for depth, expected in ((6, 3), (24, 10)):
        proposer = SuffixProposer(k=10, max_tree_depth=depth)
        proposer.start("r", prompt)
        draft = proposer.propose("r", tokens, 10)
        # depth 6: contexts of L tokens allow min(L, 6 - L) tokens, best at L = 3.
        assert draft == list(range(110, 110 + expected)), depth


def test_global_store_keeps_the_newest_requests_only():
    proposer = SuffixProposer(k=3, max_tree_depth=12, max_cached_requests=2)
    outputs = [[base, base + 1, base + 2, base + 3, base + 4] for base in (100, 200, 300)]
    for i, output in enumerate(outputs):
        proposer.start(str(i), [1])
        proposer.propose(str(i), [1, *output], 3)
        proposer.finish(str(i))
    assert proposer.num_cached_requests == 2 and proposer.num_cached_tokens == 10
    proposer.start("new", [2])
    assert proposer.propose("new", [2, 100, 101], 3) == []  # evicted
    assert proposer.propose("new", [2, 300, 301], 3) == [302, 303]
    assert proposer.propose("new", [2, 200, 201], 3) == [202, 203]


def test_global_store_memory_stays_bounded_through_compaction():
    rng = random.Random(1)
    proposer = SuffixProposer(k=4, max_tree_depth=12, max_cached_requests=3)
    for i in range(40):
        output = [rng.randrange(1000, 5000) for _ in range(300)]
        proposer.start(str(i), [1])
        proposer.propose(str(i), [1, *output], 4)
        proposer.finish(str(i))
        store = proposer.global_store
        live = proposer.num_cached_tokens + proposer.num_cached_requests
        assert store.buf.size <= 2 * live + 1024 + 301
        assert len(store.prev) == store.buf.size + 1 and len(store.head) <= store.buf.size
    proposer.start("x", [1])
    assert proposer.propose("x", [1, *output[100:110]], 4) == output[110:114]
    assert proposer.num_cached_requests == 3 and not proposer._requests.keys() - {"x"}


def test_global_store_off_with_zero_cached_requests():
    proposer = SuffixProposer(k=3, max_cached_requests=0)
    proposer.start("a", [1])
    proposer.propose("a", [1, 5, 6, 7, 8], 3)
    proposer.finish("a")
    assert proposer.num_cached_requests == 0
    assert proposer.propose("b", [5, 6], 3) == []


def test_non_continuation_is_reindexed():
    proposer = SuffixProposer(k=3, max_tree_depth=8)
    proposer.start("r", [1, 2, 3, 4])
    proposer.propose("r", [1, 2, 3, 4, 9, 9, 9], 3)
    fresh = SuffixProposer(k=3, max_tree_depth=8)
    fresh.start("r", [1, 2, 3, 4])
    other = [1, 2, 3, 4, 1, 2]
    assert proposer.propose("r", other, 3) == fresh.propose("r", other, 3) == [3, 4]


# ---- the same proposals as an explicit depth-limited suffix trie with counts ----
def trie_of(sequences: list[list[int]], depth: int) -> dict:
    """node = {"count": occurrences of its string, "kids": {token: node}}, depth-limited."""
    root: dict = {"count": 0, "kids": {}}
    for seq in sequences:
        for start in range(len(seq)):
            node = root
            for token in seq[start:start + depth]:
                node = node["kids"].setdefault(token, {"count": 0, "kids": {}})
                node["count"] += 1
    return root


def trie_draft(node: dict, room: int, min_prob: float, first_count: int
               ) -> tuple[list[int], float]:
    draft, prob, score, count = [], 1.0, 0.0, first_count
    while len(draft) < room and node["kids"]:
        token, child = max(node["kids"].items(), key=lambda kv: (kv[1]["count"], -kv[0]))
        prob *= child["count"] / count
        if prob < min_prob:
            break
        draft.append(token)
        score += prob
        node, count = child, child["count"]
    return draft, score


def trie_propose(sequences, context, k, depth, factor, min_prob, min_len, own=False):
    """own: the context is the end of sequences[0], so its own (last) occurrence, which has
    no continuation, is not counted."""
    root, best = trie_of(sequences, depth), ([], 0.0)
    for length in range(min(len(context), depth - 1), min_len - 1, -1):
        node = root
        for token in context[len(context) - length:]:
            node = node["kids"].get(token)
            if node is None:
                break
        count = 0 if node is None else node["count"] - own
        room = max(0, min(k, int(factor * length + 1e-6), depth - length))
        if count and room:
            draft = trie_draft(node, room, min_prob, count)
            best = draft if draft[1] > best[1] + EPS else best
    return best


def test_agrees_with_an_explicit_suffix_trie():
    rng = random.Random(2)
    for case in range(300):
        vocab, depth = (3, 4, 6)[case % 3], rng.choice((3, 5, 8))
        k, factor = rng.randrange(1, 7), rng.choice((0.5, 1.0, 2.0))
        min_prob = rng.choice((0.0, 0.1, 0.4))
        finished = [[rng.randrange(vocab) for _ in range(rng.randrange(2, 15))]
                    for _ in range(rng.randrange(0, 3))]
        tokens = [rng.randrange(vocab) for _ in range(rng.randrange(1, 30))]
        proposer = SuffixProposer(k, depth, 10, factor, min_prob)
        for i, output in enumerate(finished):
            proposer.start(str(i), [])
            proposer.propose(str(i), output, k)
            proposer.finish(str(i))
        proposer.start("r", tokens[:3])
        own = trie_propose([tokens], tokens, k, depth, factor, min_prob, 1, own=True)
        other = trie_propose(finished, tokens, k, depth, factor, min_prob, 2)
        expected = (other if other[1] > own[1] + EPS else own)[0]
        assert proposer.propose("r", tokens, k) == expected, (case, tokens, finished)
