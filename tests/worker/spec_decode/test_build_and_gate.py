"""build_proposer and SpeculationGate (shardserve/worker/spec_decode/__init__.py)."""

from __future__ import annotations

from shardserve.config.speculative import SpeculativeConfig
from shardserve.worker.spec_decode import (
    NgramProposer,
    SpeculationGate,
    SuffixProposer,
    build_proposer,
)


def test_build_proposer_follows_the_method():
    ngram = build_proposer(SpeculativeConfig("ngram", 3, prompt_lookup_min=2))
    assert isinstance(ngram, NgramProposer) and (ngram.min_n, ngram.max_n, ngram.k) == (2, 2, 3)
    suffix = build_proposer(SpeculativeConfig("suffix", 4, suffix_decoding_max_tree_depth=9,
                                              suffix_decoding_min_token_prob=0.3))
    assert isinstance(suffix, SuffixProposer)
    assert (suffix.k, suffix.depth, suffix.min_prob) == (4, 9, 0.3)
    for proposer in (ngram, suffix):  # one Protocol: start, propose, finish
        proposer.start("r", [1, 2, 3])
        assert proposer.propose("r", [1, 2, 3, 1, 2], 2) == [3, 1]
        proposer.finish("r")


def test_gate_stops_at_large_batches():
    gate = SpeculationGate(min_acceptance_rate=0.2, backoff_steps=4, max_batch=8)
    assert gate.should_propose("r", 8)
    assert not gate.should_propose("r", 9)


def test_gate_backs_off_on_low_acceptance_then_probes():
    gate = SpeculationGate(min_acceptance_rate=0.5, backoff_steps=3, max_batch=8)
    gate.record("r", drafted=4, accepted=3)
    gate.record("r", drafted=0, accepted=0)  # no draft: no evidence
    assert gate.should_propose("r", 1)
    gate.record("r", drafted=4, accepted=0)  # recent acceptance 2.1 / 6.8 < 0.5
    assert [gate.should_propose("r", 1) for _ in range(4)] == [False, False, True, True]
    gate.record("r", drafted=4, accepted=4)  # the probe: judged on a fresh record
    gate.record("r", drafted=4, accepted=1)  # 3.8 / 6.8: still worth it
    assert gate.should_propose("r", 1)
    gate.record("r", drafted=4, accepted=0)  # 2.66 / 8.76
    assert not gate.should_propose("r", 1)
    gate.finish("r")
    assert gate.should_propose("r", 1)


def test_gate_at_zero_rate_never_backs_off():
    gate = SpeculationGate.from_config(SpeculativeConfig("ngram", 3, min_acceptance_rate=0))
    for _ in range(5):
        gate.record("r", drafted=3, accepted=0)
    assert gate.should_propose("r", 1)
    assert (gate.backoff_steps, gate.max_batch) == (32, 2)
