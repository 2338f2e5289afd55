"""The acceptance rule for drafts without probabilities (model/rejection_sampler.py), on the real
Sampler's draws: accepted with probability p(draft), the residual on rejection, so each emitted
token is distributed as p; and per-position sampling states see the drafts before them."""

from __future__ import annotations

import pytest
import torch

from shardserve.model import rejection_sampler
from shardserve.model.sampler import RequestSamplingState, Sampler, SamplingMetadata
from shardserve.sampling_params import SamplingParams
from shardserve.worker.spec_verify import keep_verified, position_states, verify_rows


def test_verify_accepts_while_drawn_then_emits_the_draw():
    assert rejection_sampler.verify([5, 6, 7], [5, 6]) == [5, 6, 7]  # all accepted + bonus
    assert rejection_sampler.verify([5, 9, 7], [5, 6]) == [5, 9]  # rejected at 1: the draw
    assert rejection_sampler.verify([4, 6, 7], [5, 6]) == [4]  # a later match counts nothing
    assert rejection_sampler.verify([3], []) == [3]
    with pytest.raises(ValueError, match="2 drafts need 3 drawn tokens"):
        rejection_sampler.verify([1, 2], [1, 2])


def test_keep_verified_rows_and_counts():
    kept = keep_verified([5, 6, 7, 1, 2, 3, 4], [[5, 6], [], [2, 3]])
    assert kept.token_ids == [5, 6, 7, 1, 2, 3, 4]
    assert kept.rows == [0, 1, 2, 3, 4, 5, 6]
    kept = keep_verified([5, 0, 7, 1, 9, 4, 4], [[5, 6], [], [2, 3]])
    assert kept.token_ids == [5, 0, 1, 9] and kept.rows == [0, 1, 3, 4]
    assert kept.num_sampled == [2, 1, 1]
    assert verify_rows([2, 3, 9], [[5, 6], [], [2, 3]]) == [0, 1, 2, 3, 7, 8, 9]


def test_position_states_see_the_drafts_before_them():
    params = SamplingParams(temperature=1.0, seed=3)
    state = RequestSamplingState(params, [1, 2], [3])
    rows = position_states([state], [[4, 5]])
    assert [r.output_token_ids for r in rows] == [[3], [3, 4], [3, 4, 5]]
    assert rows[0] is state and state.output_token_ids == [3]  # the request's own list kept


def _target(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """The distribution the sampler draws from: softmax, then top-p's smallest prefix."""
    p = logits.softmax(-1)
    order = p.argsort(descending=True)
    before = p[order].cumsum(0) - p[order]
    keep = torch.zeros_like(p, dtype=torch.bool)
    keep[order[before < top_p]] = True
    q = torch.where(keep, p, 0)
    return q / q.sum()


@pytest.mark.parametrize("draft", [0, 3, 7])  # the most likely token, a middle one, cut by top-p
def test_first_token_is_distributed_as_p(draft):
    """20,000 verifications of one draft at one position with temperature 1, top-p 0.9: the
    draft is accepted p(draft) of the time and the emitted token's frequencies equal p."""
    n, vocab = 20_000, 8
    logits = torch.tensor([2.0, 1.5, 1.2, 1.0, 0.5, 0.2, -0.5, -3.0])
    p = _target(logits, 0.9)
    states = [RequestSamplingState(SamplingParams(temperature=1.0, top_p=0.9), [1], [])] * n
    meta = SamplingMetadata.build(states, vocab, eos_token_ids=(),
                                  generator=torch.Generator().manual_seed(0))
    drawn = Sampler()(logits.expand(n, vocab).clone(), meta).sampled_token_ids.tolist()
    # Each row is one request's position 0 of a 1-draft verify (its bonus position unused).
    emitted = [rejection_sampler.verify([t, 0], [draft])[0] for t in drawn]
    freq = torch.bincount(torch.tensor(emitted), minlength=vocab).float() / n
    accepted = sum(t == draft for t in drawn) / n
    assert abs(accepted - p[draft].item()) < 0.015, (accepted, p[draft])
    assert 0.5 * (freq - p).abs().sum().item() < 0.02, (freq, p)
    rejected = torch.tensor([t for t in drawn if t != draft])
    if rejected.numel():  # on rejection: p without the draft's mass, renormalized
        residual = p.clone()
        residual[draft] = 0
        residual /= residual.sum()
        got = torch.bincount(rejected, minlength=vocab).float() / rejected.numel()
        assert 0.5 * (got - residual).abs().sum().item() < 0.02
