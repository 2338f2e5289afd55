"""Draft proposers for speculative decoding without a draft model, run on the output rank after
sampling (issue 31): the drafts are verified as 1 + k query positions in the request's next step.

    proposer = build_proposer(config.speculative_config)
    proposer.start(req_id, prompt_ids)                 # a new request
    draft = proposer.propose(req_id, token_ids, k)     # each step: the committed tokens so far
    proposer.finish(req_id)                            # finished or aborted

    ngram.py        NgramProposer (prompt lookup) and cap_draft_len
    suffix_tree.py  SuffixProposer (suffix decoding with a global store of finished outputs)
    SpeculationGate (below): when not to propose at all, so speculation is never slower.
"""

from __future__ import annotations

from typing import Protocol

from shardserve.config.speculative import SpeculativeConfig
from shardserve.worker.spec_decode.ngram import NgramProposer, TokenIds, cap_draft_len
from shardserve.worker.spec_decode.suffix_tree import SuffixProposer

__all__ = ["NgramProposer", "Proposer", "SpeculationGate", "SuffixProposer", "build_proposer",
           "cap_draft_len"]


class Proposer(Protocol):
    # Whether propose() with k = 0 must still see the tokens (an index that learns from them).
    learns_from_every_token: bool

    def start(self, req_id: str, prompt_ids: TokenIds) -> None: ...

    def propose(self, req_id: str, token_ids: TokenIds, k: int) -> list[int]: ...

    def finish(self, req_id: str) -> None: ...


def build_proposer(cfg: SpeculativeConfig) -> Proposer:
    k = cfg.num_speculative_tokens
    assert k is not None  # resolved by SpeculativeConfig
    if cfg.method == "ngram":
        assert cfg.prompt_lookup_min is not None and cfg.prompt_lookup_max is not None
        return NgramProposer(cfg.prompt_lookup_min, cfg.prompt_lookup_max, k)
    return SuffixProposer(k, max_tree_depth=cfg.suffix_decoding_max_tree_depth,
                          max_cached_requests=cfg.suffix_decoding_max_cached_requests,
                          max_spec_factor=cfg.suffix_decoding_max_spec_factor,
                          min_token_prob=cfg.suffix_decoding_min_token_prob)


class SpeculationGate:
    """Whether a request gets a proposal this step ("never slower"): none with more than
    max_batch_for_speculation running requests; none for speculation_backoff_steps steps
    after the request's recent acceptance (accepted / drafted tokens, older verify steps
    weighted by DECAY per step) fell below min_acceptance_rate; then one probe on a fresh
    record, whose result decides again."""

    DECAY = 0.7  # a verify step's weight halves in about 2 steps: "recent" acceptance

    def __init__(self, min_acceptance_rate: float, backoff_steps: int, max_batch: int) -> None:
        self.min_rate, self.backoff_steps, self.max_batch = (
            min_acceptance_rate, backoff_steps, max_batch)
        self._record: dict[str, list[float]] = {}  # req_id -> [drafted, accepted] decayed
        self._paused: dict[str, int] = {}  # req_id -> steps left without proposals

    @classmethod
    def from_config(cls, cfg: SpeculativeConfig) -> SpeculationGate:
        return cls(cfg.min_acceptance_rate, cfg.speculation_backoff_steps,
                   cfg.max_batch_for_speculation)

    def should_propose(self, req_id: str, num_running: int) -> bool:
        """Call once per request per step (it counts the paused steps down)."""
        left = self._paused.get(req_id)
        if left is not None:
            if left > 1:
                self._paused[req_id] = left - 1
                return False
            del self._paused[req_id]  # probe again, judged on its own result
            self._record.pop(req_id, None)
        return num_running <= self.max_batch

    def record(self, req_id: str, drafted: int, accepted: int) -> None:
        """The result of verifying a request's draft of `drafted` tokens."""
        if drafted <= 0:
            return
        past = self._record.setdefault(req_id, [0.0, 0.0])
        past[0] = past[0] * self.DECAY + drafted
        past[1] = past[1] * self.DECAY + accepted
        if past[1] < self.min_rate * past[0]:
            self._paused[req_id] = self.backoff_steps

    def finish(self, req_id: str) -> None:
        self._record.pop(req_id, None)
        self._paused.pop(req_id, None)
