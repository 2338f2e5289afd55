"""The scheduler's results side: a step's sampled tokens folded into its requests (stops,
grammars, pooled vectors, rolled-back drafts), as EngineCoreOutputs.

A mixin of Scheduler (scheduler.py), which owns the requests and how they end (`_finish`).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from shardserve.engine.request import Request, RequestStatus
from shardserve.messages import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput

if TYPE_CHECKING:
    from shardserve.engine.spec_decode_scheduling import SpecDecodeScheduling

logger = logging.getLogger(__name__)


class SchedulerResults:
    requests: dict[str, Request]
    max_model_len: int
    spec: SpecDecodeScheduling

    def _finish(self, request: Request, status: RequestStatus) -> None:  # Scheduler's
        raise NotImplementedError

    def update_from_output(
        self, sched: SchedulerOutput, output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Fold one step's sampled tokens in (steps complete in the order they were scheduled).

        A preempted request still takes the token sampled for it before the preemption (it was
        computed from the right context), so preemption never changes what a request outputs.
        """
        outputs = []
        prompt_logprobs = dict(output.prompt_logprobs or {})
        offsets = output.token_offsets()
        drafts = output.draft_token_ids or {}
        for j, rid in enumerate(output.req_ids):
            request = self.requests.get(rid)
            if request is None:
                continue  # finished or aborted while the step ran: its token is discarded
            request.num_output_placeholders -= 1
            # (None: no request of the step verified a draft)
            verified = 0 if output.num_drafts is None else int(output.num_drafts[j])
            tokens = self._fold_tokens(request, sched, output, offsets[j], offsets[j + 1],
                                       verified)
            # Else stale: a step for it is under way, or it was preempted (recomputes first).
            if request.status == RequestStatus.RUNNING and not request.num_output_placeholders:
                request.spec_token_ids = drafts.get(rid, [])
            outputs.append(
                EngineCoreOutput(
                    request_id=rid,
                    new_token_ids=tokens,
                    finish_reason=request.finish_reason,
                    stop_reason=request.stop_reason,
                    new_logprobs=_logprobs_entries(output, offsets[j], len(tokens)),
                    num_cached_tokens=request.num_cached_tokens,
                    prompt_logprobs=prompt_logprobs.pop(rid, None),
                )
            )
        # Prefill chunks that sampled nothing still report their prompt logprobs.
        outputs += [EngineCoreOutput(rid, [], prompt_logprobs=lps)
                    for rid, lps in prompt_logprobs.items() if rid in self.requests]
        return outputs + self._finish_pooled(output)

    def _fold_tokens(self, request: Request, sched: SchedulerOutput, output: ModelRunnerOutput,
                     start: int, end: int, verified: int) -> list[int]:
        """Append a step's tokens for one request up to the first that ends it (tokens after
        it are dropped, as a step-by-step engine would never have sampled them); roll back the
        positions of rejected drafts: its draft positions (`slots`, the drafts it was sent
        or the slots the workers filled with `verified` drafts) less those accepted."""
        rid = request.request_id
        slots = len(sched.scheduled_spec_decode_tokens.get(rid, ())) or \
            sched.draft_slots.get(rid, 0)
        if slots:
            accepted = self.spec.on_verified(request, verified, end - start)
            if request.status == RequestStatus.RUNNING:  # (a preempted one computes from 0)
                request.num_computed_tokens -= slots - accepted
                request.num_unverified_drafts -= slots
        tokens = []
        for token in output.sampled_token_ids[start:end].tolist():
            tokens.append(token)
            request.output_token_ids.append(token)
            self._check_stop(request, token)
            if request.grammar is not None:
                self._advance_grammar(request, token)
            if request.status.is_finished:
                break
        return tokens

    def _finish_pooled(self, output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """Pooling requests end with their vector (their KV blocks are freed; full ones stay
        in the prefix cache). Their prefill counted a placeholder for a token never sampled
        (max_tokens=1, so nothing more was scheduled for them)."""
        outputs = []
        for rid, vector in (output.pooler_output or {}).items():
            request = self.requests.get(rid)
            if request is None:
                continue  # aborted while the step ran
            request.num_output_placeholders -= 1
            self._finish(request, RequestStatus.FINISHED_STOPPED)
            outputs.append(EngineCoreOutput(rid, [], "stop", num_cached_tokens=
                                            request.num_cached_tokens, pooled=vector))
        return outputs

    def _advance_grammar(self, request: Request, token: int) -> None:
        """The matcher takes the token. A finished grammar ends the request (as its EOS would,
        also with ignore_eos); a rejected token (never, with the bitmask applied) ends it too."""
        if request.grammar.accept(token) and not request.grammar.terminated:
            return
        if request.status.is_finished:
            return
        if request.grammar.failed:
            logger.error("request %s: %s", request.request_id, request.grammar.failed)
        self._finish(request, RequestStatus.FINISHED_STOPPED)

    def _check_stop(self, request: Request, token: int) -> None:
        params = request.sampling_params
        n_out = len(request.output_token_ids)
        if n_out >= params.min_tokens:
            if token in (params.stop_token_ids or ()):
                request.stop_reason = token
                self._finish(request, RequestStatus.FINISHED_STOPPED)
                return
            if not params.ignore_eos and token in request.eos_token_ids:
                self._finish(request, RequestStatus.FINISHED_STOPPED)
                return
        if n_out >= request.max_output_tokens or request.num_tokens >= self.max_model_len:
            self._finish(request, RequestStatus.FINISHED_LENGTH)


def _logprobs_entries(output: ModelRunnerOutput, start: int,
                      count: int) -> list[dict[int, tuple[float, int]]] | None:
    """The logprobs entries of rows start .. start + count (one a token)."""
    if output.logprobs is None or output.logprob_token_ids is None:
        return None
    entries = []
    for j in range(start, start + count):
        ids = output.logprob_token_ids[j].tolist()
        lps = output.logprobs[j].tolist()
        ranks = output.sampled_token_ranks
        entry = {ids[0]: (lps[0], int(ranks[j]) if ranks is not None else 0)}
        for rank, (tid, lp) in enumerate(zip(ids[1:], lps[1:], strict=True), start=1):
            entry.setdefault(tid, (lp, rank))
        entries.append(entry)
    return entries
