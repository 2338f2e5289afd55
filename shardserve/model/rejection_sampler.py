"""Verification of draft tokens that come without probabilities (n-gram and suffix lookup):
which of a request's drafts the target model accepts, exactly as sampling without speculation.

A draft d at some position is a point mass q = δ_d. Speculative sampling's rule for it: accept
d with probability min(1, p(d) / q(d)) = p(d) (p: the target's distribution there, after
temperature, top-k/top-p/min-p, penalties, logits controls and the grammar's mask, given the
drafts before it as context); on rejection, emit a token drawn from the residual
max(0, p - q) renormalized, i.e. p with d's mass removed. Each emitted token is then distributed
exactly as p: P(d) = p(d), and P(x) = (1 - p(d)) · p(x) / (1 - p(d)) = p(x) for x ≠ d.

We draw that rule through the sampler's own draw at each position: x ~ p, the token the
sampler picks there (model/sampler.py: argmax for greedy rows, the exponential race for random
ones, from the position's generator), and accept d iff x == d. P(x == d) = p(d) is the
acceptance (x == d plays the part of u ≤ p(d)), and given x ≠ d, x is distributed as p
restricted to tokens ≠ d and renormalized: the residual. So the first rejected position emits x
itself, and after the last draft the bonus token is that position's x. For greedy rows this is
"accept while the draft equals the argmax, then emit the argmax". Because a seeded request's
draw at output position t comes from a generator seeded by (seed, t) alone, its tokens with
speculation are the very tokens it samples without (not only the same distribution); an
unseeded request's draws come from the shared generator, in a different order than without
speculation, with the same distribution.

`_accept_rule` is the one place the rule lives; tests swap it for a deliberately wrong one (to
show the distribution test catches it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

# (the sampler's draws at a request's 1 + d verified positions, its d drafts) → how many of
# the drafts are accepted.
AcceptRule = Callable[[Sequence[int], Sequence[int]], int]


def accept_while_drawn(drawn: Sequence[int], drafts: Sequence[int]) -> int:
    """The leading drafts equal to the token drawn at their position."""
    accepted = 0
    for token, draft in zip(drawn, drafts, strict=False):
        if token != draft:
            break
        accepted += 1
    return accepted


_accept_rule: AcceptRule = accept_while_drawn


def verify(drawn: Sequence[int], drafts: Sequence[int]) -> list[int]:
    """The tokens a request emits from a verify step: the accepted drafts, then the token drawn
    at the next position (the correction at a rejection, or the bonus token after the last
    draft). `drawn` has len(drafts) + 1 entries."""
    if len(drawn) != len(drafts) + 1:
        raise ValueError(f"{len(drafts)} drafts need {len(drafts) + 1} drawn tokens, "
                         f"got {len(drawn)}")
    accepted = _accept_rule(drawn, drafts)
    return [*drafts[:accepted], drawn[accepted]]
