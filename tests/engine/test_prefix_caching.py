"""Prefix caching: the block pool's hashes, sharing, LRU eviction and invariants (pure Python),
and an engine that reuses cached blocks giving the same outputs as one that does not (async
scheduling, preemption, n > 1, TP=2 on mp), counting its hits, and always recomputing at least
the last prompt token."""

from __future__ import annotations

import random

import pytest

from shardserve import LLM, SamplingParams
from shardserve.engine.kv_cache import KVCacheManager

BS = 4


def check_invariants(kv: KVCacheManager) -> None:
    """A block is free with no holder, or held by as many tables as its count says; a
    registered hash maps to a block that carries it."""
    held: dict[int, int] = {}
    for table in kv._tables.values():
        for b in table:
            held[b] = held.get(b, 0) + 1
    for b in range(kv.num_blocks):
        assert kv._ref[b] == held.get(b, 0), b
        assert (b in kv._free) == (kv._ref[b] == 0), b
    for digest, b in kv._by_hash.items():
        assert kv._hash[b] == digest


def test_a_shared_prefix_is_found_and_held_twice():
    kv = KVCacheManager(16, BS, enable_prefix_caching=True)
    a = list(range(100, 111))  # 11 tokens: two full blocks and a partial one
    assert kv.allocate("a", len(a)) is not None
    kv.register_full_blocks("a", a, len(a))
    assert kv.num_registered("a") == 2
    b = a[:8] + [7, 7, 7]  # same first two blocks
    prefix = kv.cached_prefix(b, len(b) - 1)
    assert prefix == kv.block_ids("a")[:2]
    assert kv.allocate("b", len(b), prefix) is not None
    assert kv.block_ids("b")[:2] == prefix and kv._ref[prefix[0]] == 2
    check_invariants(kv)
    # A different first block changes every later hash (the chain), even with equal tokens.
    assert kv.cached_prefix([0, 0, 0, 0] + a[4:8] + [1], 8) == []


def test_the_last_token_is_always_left_to_compute():
    kv = KVCacheManager(16, BS, enable_prefix_caching=True)
    tokens = list(range(8))  # exactly two full blocks
    kv.allocate("a", 8)
    kv.register_full_blocks("a", tokens, 8)
    assert len(kv.cached_prefix(tokens, len(tokens) - 1)) == 1  # 7 tokens: one whole block


def test_freed_blocks_stay_cached_until_evicted_least_recent_first():
    kv = KVCacheManager(4, BS, enable_prefix_caching=True)
    tokens = list(range(12))
    kv.allocate("a", 12)
    kv.register_full_blocks("a", tokens, 12)
    first, second, third = kv.block_ids("a")
    kv.free("a")
    assert kv.num_free_blocks == 4 and len(kv._by_hash) == 3  # still cached
    # Released last-first: the unregistered spare block goes first, then the tail blocks.
    assert list(kv._free) == [3, third, second, first]
    kv.allocate("x", 8)  # takes the spare and `third` (evicted)
    assert kv.cached_prefix(tokens, 11) == [first, second]
    check_invariants(kv)


def test_random_traffic_keeps_the_invariants():
    rng = random.Random(0)
    kv = KVCacheManager(24, BS, enable_prefix_caching=True)
    prompts = [[rng.randrange(5) for _ in range(rng.randrange(1, 30))] for _ in range(8)]
    live: dict[str, list[int]] = {}
    for step in range(400):
        if live and rng.random() < 0.4:
            rid = rng.choice(list(live))
            kv.free(rid)
            del live[rid]
            continue
        tokens = list(rng.choice(prompts))
        rid = f"r{step}"
        prefix = kv.cached_prefix(tokens, len(tokens) - 1)
        if kv.allocate(rid, len(tokens), prefix) is not None:
            kv.count_lookup(len(tokens), len(prefix) * BS)
            kv.register_full_blocks(rid, tokens, len(tokens))
            live[rid] = tokens
        check_invariants(kv)
    assert kv.stats.hits > 0


PREFIX = "You are a helpful assistant. Answer briefly and clearly, in one line. " * 2


def _run(model, **options):
    llm = LLM(str(model), **{"dtype": "float32", "max_model_len": 256, "seed": 0, **options})
    try:
        prompts = [PREFIX + q for q in ("What is a cat?", "What is a dog?", "Why?")]
        greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
        seeded = SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=16)
        first = llm.generate(prompts, greedy, use_tqdm=False)
        again = llm.generate(prompts[:1] * 2 + prompts[1:], [greedy, seeded, greedy, greedy],
                             use_tqdm=False)
        outs = [[c.token_ids for c in o.outputs] for o in first + again]
        return outs, [o.num_cached_tokens for o in first + again], llm.get_metrics()
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def uncached(tiny_llama_dir):
    outs, cached, metrics = _run(tiny_llama_dir, enable_prefix_caching=False)
    assert not any(cached) and metrics["prefix_cache_hits"] == 0
    return outs


@pytest.mark.parametrize("options", [
    {}, {"async_scheduling": False},
    {"max_model_len": 160, "num_blocks_override": 12, "max_num_batched_tokens": 40},
], ids=["async", "sync", "preempted"])
def test_cached_outputs_equal_uncached(tiny_llama_dir, uncached, options):
    outs, cached, metrics = _run(tiny_llama_dir, **options)
    assert outs == uncached
    assert metrics["prefix_cache_hits"] > 0 and 0 < metrics["prefix_cache_hit_rate"] < 1
    prompt_len = len(LLM_TOKENS(tiny_llama_dir))
    assert cached[3] >= 16 * ((prompt_len - 1) // 16 - 1)  # the repeat reuses its blocks
    assert all(c < prompt_len for c in cached)  # never the whole prompt
    if "num_blocks_override" in options:
        assert metrics["num_preemptions"] > 0


def LLM_TOKENS(model):  # noqa: N802 - a helper named for what it returns
    from shardserve.model.loader import load_tokenizer

    return load_tokenizer(model).encode(PREFIX + "What is a cat?")


@pytest.mark.slow
def test_mp_tp2_cached_outputs_equal_uncached(tiny_llama_dir, uncached):
    outs, _, metrics = _run(tiny_llama_dir, tensor_parallel_size=2,
                            distributed_executor_backend="mp")
    assert outs == uncached and metrics["prefix_cache_hits"] > 0
