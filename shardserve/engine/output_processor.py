"""Turns the engine core's token ids into RequestOutputs: detokenization, stop strings, n > 1.

Runs in the front end (the caller's process; the API server's in the server), never in workers.

Detokenization is incremental, so a step costs O(new tokens), not O(output). With a fast
(`tokenizers`) tokenizer each sequence feeds its tokens to a `tokenizers` DecodeStream, which
holds back a multi-byte character until its last byte arrives (one call into Rust a token; the
transformers wrapper's decode costs 3-4x more a call, which the API server pays for every
streamed token). Otherwise each sequence keeps two offsets into its tokens, `prefix` <= `read`:
text for tokens[:read] is final; a step decodes tokens[prefix:] and tokens[prefix:read] and
appends the difference. Both decodes start at the same token, so whatever a tokenizer does at
the start of a piece (SentencePiece drops a leading space) cancels out, and a window that ends
inside a multi-byte character (the decode ends in U+FFFD) waits for the next token. At the end
of a sequence, tokens the stream still holds are flushed the second way, so the text equals a
whole decode. Stop strings are searched only in the new text plus the longest stop string's
length before it.

`stream_interval` (vLLM's `--stream-interval`): while streaming, a request's output is handed
out when it has its first token, every `stream_interval` tokens after that, and when it ends,
instead of every step. Fewer outputs mean fewer server-sent events, each carrying several
tokens: on a machine whose cores the model's kernels already fill, the front end's work per
event is taken from the model's steps.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from shardserve.messages import EngineCoreOutput, PromptLogprobs
from shardserve.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from shardserve.sampling_params import SamplingParams


@dataclass
class _ChildState:
    """One sequence of a request (a request with n > 1 has n of them)."""

    index: int
    params: SamplingParams
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prefix_offset: int = 0  # see the module docstring
    read_offset: int = 0
    stream: DecodeStream | None = None
    fed: int = 0  # tokens given to `stream` so far


@dataclass
class _RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: dict[str, _ChildState]
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(time.time()))
    num_cached_tokens: int = 0
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    tokens_handed_out: int = 0  # the longest child's tokens in the last output handed out
    pooled: Any = None  # a pooling request's vector (EngineCoreOutput.pooled)

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.children.values())


class OutputProcessor:
    def __init__(self, tokenizer, stream: bool = False, stream_interval: int = 1) -> None:
        if stream_interval < 1:
            raise ValueError(f"stream_interval={stream_interval} must be >= 1 (1 streams "
                             f"every token)")
        self.tokenizer = tokenizer
        self._fast = _fast_backend(tokenizer)
        # Without streaming, text is only needed for stop strings and at the end of a sequence.
        self.stream = stream
        self.stream_interval = stream_interval
        self._requests: dict[str, _RequestState] = {}
        self._parent_of: dict[str, str] = {}  # child (engine) request id → parent id

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        children: dict[str, SamplingParams],
    ) -> None:
        states = {}
        for index, (child_id, params) in enumerate(children.items()):
            if index > 0 and params.prompt_logprobs is not None:  # the first child's serve all
                params = dataclasses.replace(params, prompt_logprobs=None)
            states[child_id] = _ChildState(
                index, params, logprobs=[] if params.logprobs is not None else None,
                stream=DecodeStream(skip_special_tokens=params.skip_special_tokens)
                if self._fast is not None and params.detokenize else None)
            self._parent_of[child_id] = request_id
        state = _RequestState(request_id, prompt, prompt_token_ids, states)
        if next(iter(children.values())).prompt_logprobs is not None:
            state.prompt_logprobs = [None] * len(prompt_token_ids)
        self._requests[request_id] = state

    def child_ids(self, request_id: str) -> list[str]:
        state = self._requests.get(request_id)
        return list(state.children) if state else []

    def parent_of(self, child_id: str) -> str | None:
        return self._parent_of.get(child_id)

    def produced(self, child_id: str) -> list[int] | None:
        """The tokens an open child request has produced so far (None: finished, or unknown).
        What a replica that takes it over continues from (replica_recovery.py)."""
        parent = self._parent_of.get(child_id)
        if parent is None:
            return None
        child = self._requests[parent].children[child_id]
        return None if child.finish_reason is not None else list(child.token_ids)

    def num_tokens(self, request_id: str) -> int | None:
        """Tokens an open request's children have produced, all together (None: it ended).
        Grows with every token, whichever child ends first (replica recovery's progress)."""
        state = self._requests.get(request_id)
        return None if state is None else sum(len(c.token_ids) for c in state.children.values())

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    def process(self, outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """Fold one step's outputs in. Returns the RequestOutputs of requests that changed, and
        engine request ids to abort (those a stop string finished)."""
        touched: dict[str, _RequestState] = {}
        to_abort: list[str] = []
        for out in outputs:
            parent_id = self._parent_of.get(out.request_id)
            if parent_id is None:
                continue
            state = self._requests[parent_id]
            child = state.children[out.request_id]
            if child.finish_reason is not None:
                # Its stop string already ended it (and the engine was told to abort it), but
                # with async scheduling the step under way still reports a token. Folding that
                # in would un-finish the child (the engine's finish_reason is None), and a
                # request with n > 1, kept for its other children, would never end.
                continue
            self._note_times(state, out)
            if out.pooled is not None:
                state.pooled = out.pooled
            if out.prompt_logprobs is not None and state.prompt_logprobs is not None:
                self._add_prompt_logprobs(state, out.prompt_logprobs)
            if self._update_child(child, out):
                to_abort.append(out.request_id)
            touched[parent_id] = state
        results = [self._make_output(s) for s in touched.values() if self._due(s)]
        for s in touched.values():
            if s.finished:
                self._forget(s)
        return results, to_abort

    def _add_prompt_logprobs(self, state: _RequestState, chunk: PromptLogprobs) -> None:
        """Entry p + 1 from position p; a recomputed chunk (after preemption) fills the same
        entries again."""
        assert state.prompt_logprobs is not None
        decode = next(iter(state.children.values())).params.detokenize
        for i, (ids, lps) in enumerate(zip(chunk.token_ids.tolist(), chunk.logprobs.tolist(),
                                           strict=True)):
            entry = {ids[0]: Logprob(lps[0], int(chunk.ranks[i]),
                                     self._decode_one(ids[0], decode))}
            for rank, (tid, lp) in enumerate(zip(ids[1:], lps[1:], strict=True), start=1):
                entry.setdefault(tid, Logprob(lp, rank, self._decode_one(tid, decode)))
            state.prompt_logprobs[chunk.start + 1 + i] = entry

    @staticmethod
    def _note_times(state: _RequestState, out: EngineCoreOutput) -> None:
        now, metrics = time.time(), state.metrics
        if out.new_token_ids:
            if metrics.first_token_time is None:
                metrics.first_token_time = now
            metrics.last_token_time = now
        state.num_cached_tokens = max(state.num_cached_tokens, out.num_cached_tokens)

    def _due(self, state: _RequestState) -> bool:
        """Whether a changed request's output is handed out now (see `stream_interval`)."""
        if self.stream_interval == 1 or state.finished:
            return True
        tokens = max(len(c.token_ids) for c in state.children.values())
        if state.tokens_handed_out and tokens - state.tokens_handed_out < self.stream_interval:
            return False
        state.tokens_handed_out = tokens
        return True

    def abort(self, request_id: str) -> RequestOutput | None:
        state = self._requests.get(request_id)
        if state is None:
            return None
        for child in state.children.values():
            child.finish_reason = child.finish_reason or "abort"
        self._forget(state)
        return self._make_output(state)

    def _forget(self, state: _RequestState) -> None:
        self._requests.pop(state.request_id, None)
        for child_id in state.children:
            self._parent_of.pop(child_id, None)

    def _update_child(self, child: _ChildState, out: EngineCoreOutput) -> bool:
        """Returns True when a stop string ended the sequence (the engine must abort it).

        A step of speculative decoding brings several tokens: with stop strings they are taken
        one at a time, so those after the token that completes a stop string are dropped, as an
        engine that samples one token a step never produces them."""
        tokens = out.new_token_ids
        if len(tokens) < 2 or not child.params.stop or not child.params.detokenize:
            return self._update_child_by(child, out)
        for i, token in enumerate(tokens):
            last = i == len(tokens) - 1
            one = EngineCoreOutput(
                out.request_id, [token], out.finish_reason if last else None,
                out.stop_reason if last else None,
                new_logprobs=out.new_logprobs[i:i + 1] if out.new_logprobs else None)
            hit = self._update_child_by(child, one)
            if child.finish_reason is not None:  # the engine is told only if it still runs
                return hit and out.finish_reason is None
        return False

    def _update_child_by(self, child: _ChildState, out: EngineCoreOutput) -> bool:
        child.token_ids.extend(out.new_token_ids)
        if out.new_logprobs is not None and child.logprobs is not None:
            self._add_logprobs(child, out)
        params = child.params
        # detokenize=False: token ids only (stop strings were refused with it).
        if params.detokenize and (self.stream or params.stop or out.finish_reason is not None):
            old_len = len(child.text)
            self._decode_new(child, final=out.finish_reason is not None)
            hit = None
            if params.stop:  # the last token too: a length-finished text may end in a stop
                longest = max(len(stop) for stop in params.stop)
                start = max(0, old_len - longest + 1)
                hit = _find_stop(child.text, params.stop, params.include_stop_str_in_output,
                                 start)
            if hit is not None:
                child.text, child.stop_reason = hit
                child.finish_reason = "stop"
                return out.finish_reason is None  # still running in the engine: abort it
        child.finish_reason = out.finish_reason
        child.stop_reason = out.stop_reason
        return False

    def _decode_new(self, child: _ChildState, final: bool) -> None:
        """Append the text of the tokens not decoded yet (see the module docstring); `final`
        flushes a trailing incomplete character as U+FFFD, as a whole decode would."""
        if child.stream is not None:
            self._stream_new(child)
            if not final or child.read_offset == len(child.token_ids):
                return
            # Held back at the end (a cut character, or tokens that decode to nothing): the
            # offsets below take over from a few tokens back.
            child.prefix_offset = max(0, child.read_offset - 4)
        ids, skip = child.token_ids, child.params.skip_special_tokens
        settled = self.tokenizer.decode(ids[child.prefix_offset : child.read_offset],
                                        skip_special_tokens=skip)
        window = self.tokenizer.decode(ids[child.prefix_offset :], skip_special_tokens=skip)
        if len(window) > len(settled) and (final or not window.endswith("\ufffd")):
            child.text += window[len(settled) :]
            child.prefix_offset, child.read_offset = child.read_offset, len(ids)

    def _stream_new(self, child: _ChildState) -> None:
        """Feed the tokens the stream has not seen; read_offset ends up just past the last
        token that released text (every token after it is held back or decodes to nothing)."""
        assert child.stream is not None
        ids = child.token_ids
        for i in range(child.fed, len(ids)):
            piece = child.stream.step(self._fast, ids[i])
            if piece:
                child.text += piece
                child.read_offset = i + 1
        child.fed = len(ids)

    def _decode_one(self, token_id: int, decode: bool = True) -> str | None:
        if not decode:  # detokenize=False: as vLLM, a logprob carries no text then
            return None
        if self._fast is not None:
            return self._fast.decode([token_id], skip_special_tokens=False)
        return self.tokenizer.decode([token_id])

    def _add_logprobs(self, child: _ChildState, out: EngineCoreOutput) -> None:
        for token_id, entry in zip(out.new_token_ids, out.new_logprobs or [], strict=False):
            child.logprobs.append(  # type: ignore[union-attr]
                {
                    tid: Logprob(lp, rank, self._decode_one(tid, child.params.detokenize))
                    for tid, (lp, rank) in entry.items()
                }
            )
            child.cumulative_logprob += entry[token_id][0]

    @staticmethod
    def _make_output(state: _RequestState) -> RequestOutput:
        completions = [
            CompletionOutput(
                index=c.index,
                text=c.text,
                token_ids=list(c.token_ids),
                cumulative_logprob=c.cumulative_logprob if c.logprobs is not None else None,
                logprobs=list(c.logprobs) if c.logprobs is not None else None,
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
            )
            for c in state.children.values()
        ]
        finished = state.finished
        if finished and state.metrics.finished_time is None:
            state.metrics.finished_time = time.time()
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            outputs=completions,
            finished=finished,
            metrics=dataclasses.replace(state.metrics),
            num_cached_tokens=state.num_cached_tokens,
            pooled=state.pooled,
            prompt_logprobs=list(state.prompt_logprobs) if finished
            and state.prompt_logprobs is not None else None,
        )


def _fast_backend(tokenizer: Any) -> Tokenizer | None:
    """The `tokenizers` Tokenizer behind a fast tokenizer whose decode adds nothing to the
    backend's (no clean-up of spaces), else None (the offsets path)."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if not isinstance(backend, Tokenizer):
        return None
    if getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return None
    return backend


def _find_stop(
    text: str, stops: list[str], include: bool, start: int = 0
) -> tuple[str, str] | None:
    """The text cut at the earliest stop string found at or after `start`, and that string;
    None when none occurs."""
    best: tuple[int, str] | None = None
    for stop in stops:
        pos = text.find(stop, start)
        if pos != -1 and (best is None or pos < best[0]):
            best = (pos, stop)
    if best is None:
        return None
    pos, stop = best
    return text[: pos + len(stop) if include else pos], stop
