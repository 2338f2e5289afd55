"""The scheduler's side of speculative decoding: which drafts a request verifies, the rollback
of rejected positions, when speculation pays (never slower), and the acceptance counters.

A step of the workers returns, with each request's sampled tokens, up to k drafts for its next
step (worker/spec_decode/: n-gram or suffix lookup). The scheduler schedules that next step as
1 + d query positions (the last sampled token, then the d drafts), KV blocks allocated for all;
the worker computes logits at each and emits 1..d+1 tokens (model/rejection_sampler.py). The
rejected positions are rolled back here:

    before:    num_tokens T, num_computed T - 1, drafts d
    scheduled: num_computed T + d                   (the drafts' KV is written too)
    verified:  a drafts accepted, a + 1 tokens out:  num_tokens T + a + 1
    rollback:  num_computed T + d - (d - a) = T + a  (one token left to compute, as after a
               plain decode)

Invariants: drafts are never part of a request's token ids, so prefix-caching hashes (taken
over token ids within num_computed, see scheduler._advance) never include one; the KV written at
a rejected position lies beyond num_computed and is overwritten when that position is computed
again; a request holds at most the blocks of num_tokens + k tokens (the next verify step's), so
a rejection frees nothing that the next step would not allocate again.

Asynchronous scheduling: a request's drafts come back with the step that sampled the token
they follow, too late for the step planned while that one runs. So that step gets draft
*slots* (SchedulerOutput.draft_slots): the workers, which finished the step before, know how
many drafts it accepted and hold their own proposals (every rank of the stage proposes), so
they place the request and fill in up to that many drafts. Here its positions are counted as
if every draft were accepted (num_computed_tokens an upper bound; `num_unverified_drafts` the
draft positions in flight), and each step's rollback, when it is folded in, is its slots less
the drafts accepted:

    scheduled N:    num_tokens T, num_computed T + d, unverified d        (d drafts or slots)
    scheduled N+1:  num_computed T + d + 1 + s, unverified d + s           (s slots)
    N folded in:    a accepted: num_tokens T + a + 1, num_computed T + a + 1 + s, unverified s
                    (what the workers compute in N+1: the token at T + a, then <= s drafts)

A constrained request still waits for its step (its bitmask needs the drafts here), as does
every request with pipeline stages; the drafts that come back with a step are used where the
request has none in flight (the queue ran dry, or it waited).

Never slower: worker/spec_decode's SpeculationGate, consulted once per request per step,
decides whether its drafts are used (none above max_batch_for_speculation running requests;
at most max_verify_rows rows a step, drafts included, shared among the requests;
none for speculation_backoff_steps steps after its recent acceptance fell below
min_acceptance_rate, then a probe). The workers also propose nothing above the batch limit.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from shardserve.engine.request import Request
from shardserve.worker.spec_decode import SpeculationGate

if TYPE_CHECKING:
    from shardserve.config.speculative import SpeculativeConfig


@dataclass
class SpecDecodeStats:
    """Counters since start (vLLM's spec_decode metrics)."""

    num_drafts: int = 0  # verify steps of a request with at least one draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # [k]: accepted at position i


class SpecDecodeScheduling:
    def __init__(self, config: SpeculativeConfig | None) -> None:
        self.enabled = config is not None
        self.k = (config.num_speculative_tokens or 0) if config is not None else 0
        self.gate = SpeculationGate.from_config(config) if config is not None else None
        self.stats = SpecDecodeStats(accepted_per_pos=[0] * self.k)
        self.max_rows = config.max_verify_rows if config is not None else 0
        self._rows_left = self._requests_left = 0

    def begin_step(self, num_running: int) -> None:
        """A step's draft budget: max_verify_rows less one row per running request, shared
        among them as they are scheduled (each takes its share of what is left)."""
        self._rows_left = max(0, self.max_rows - num_running) if self.max_rows else 1 << 30
        self._requests_left = max(1, num_running)

    def allowance(self, request: Request, budget: int, room: int, num_running: int) -> int:
        """How many drafts the request's next token may take (called once per scheduled step
        of a running request): none unless the gate says so; at most `budget` - 1 (the
        step's tokens left), `room` and its share of the step's rows (begin_step)."""
        if self.gate is None:
            return 0
        share = self._rows_left // self._requests_left
        self._requests_left = max(1, self._requests_left - 1)
        # request.spec: the gate's last word on the request (holds_back reads it).
        request.spec = self.gate.should_propose(request.request_id, num_running)
        if not request.spec:
            return 0
        allowed = max(0, min(budget - 1, room, self.k, share))
        self._rows_left -= allowed
        return allowed

    def take_drafts(self, request: Request, usable: bool, budget: int, room: int,
                    num_running: int) -> list[int]:
        """The drafts to verify with the request's next token: its allowance of them, if they
        are `usable` (proposed after its last token, which is all it computes now). The
        request's drafts are used up either way."""
        drafts, request.spec_token_ids = request.spec_token_ids, []
        allowed = self.allowance(request, budget, room, num_running)
        taken = drafts[:allowed] if usable else []
        self._rows_left += allowed - len(taken)
        return taken

    def holds_back(self, request: Request) -> bool:
        """A speculating constrained request with a step in flight waits for it (its drafts
        and their bitmask need that step's tokens; see the module's docstring). Not judged yet
        (None: its prefill is in flight) counts as speculating, so its first decode can verify
        the prefill's drafts."""
        return (self.enabled and request.num_output_placeholders > 0
                and request.grammar is not None
                and (request.spec is not False or request.num_unverified_drafts > 0))

    def on_verified(self, request: Request, num_drafts: int, num_emitted: int) -> int:
        """Count a verify step of `num_drafts` drafts that emitted `num_emitted` tokens (before
        any stop cut them); returns the drafts accepted."""
        accepted = max(0, min(num_drafts, num_emitted - 1))
        if num_drafts <= 0:
            return 0
        stats = self.stats
        stats.num_drafts += 1
        stats.num_draft_tokens += num_drafts
        stats.num_accepted_tokens += accepted
        for i in range(accepted):
            stats.accepted_per_pos[i] += 1
        if self.gate is not None:
            self.gate.record(request.request_id, num_drafts, accepted)
        return accepted

    def finish(self, request_id: str) -> None:
        if self.gate is not None:
            self.gate.finish(request_id)


def spec_decode_line(stats: Any, last: Any) -> tuple[str | None, Any]:
    """The periodic stats line of speculative decoding over the interval since `last` (both
    core_wire.SchedulerStats totals), as vLLM logs it; None when no verify step ran. Returns
    the line and the totals to diff against next time."""
    steps = stats.spec_num_drafts - last.spec_num_drafts
    if steps <= 0:
        return None, stats
    drafted = stats.spec_num_draft_tokens - last.spec_num_draft_tokens
    accepted = stats.spec_num_accepted_tokens - last.spec_num_accepted_tokens
    before = list(last.spec_accepted_per_pos) + [0] * len(stats.spec_accepted_per_pos)
    per_pos = ", ".join(f"{(n - before[i]) / steps:.3f}"
                        for i, n in enumerate(stats.spec_accepted_per_pos))
    line = (f"SpecDecoding metrics: Mean acceptance length: {1 + accepted / steps:.2f}, "
            f"Accepted: {accepted} tokens, Drafted: {drafted} tokens, Per-position acceptance "
            f"rate: {per_pos}, Avg Draft acceptance rate: {100 * accepted / max(1, drafted):.1f}%")
    return line, stats
