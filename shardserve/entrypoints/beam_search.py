"""Beam search over the engine's ordinary requests, as vLLM v1 runs it at the LLM level.

Each step, every live beam of every prompt is one engine request, all submitted as one batch:
its prompt is the beam's tokens so far, it generates ONE token and returns the top
2 * beam_width logprobs (plus the sampled token's). Every candidate (beam + token) gets the
beam's cumulative logprob plus the token's; a candidate ending in EOS (unless ignore_eos) is
set aside as finished, the rest are ranked by score and the best beam_width kept. After
max_tokens steps the live beams join the finished ones and the best beam_width of all, by score,
are returned, best first:

    score = cum_logprob / len(tokens) ** length_penalty     (tokens: prompt + generated, an
                                                             ending EOS not counted)

Memory: a beam's request shares its prompt's (and its ancestors') full KV blocks through prefix
caching: they were registered by the previous step's requests, so each step computes only the
tokens past the last full block. The KV blocks in use grow with the beams' own tokens, not with
beam_width copies of the prompt. Without prefix caching every beam recomputes its whole prefix.

`BeamSearch` is the search itself, independent of how its requests run: `LLM.beam_search` drives
it through `LLM.generate`, the server (server/beam_serving.py) through the async engine.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from shardserve.outputs import Logprob, RequestOutput
from shardserve.sampling_params import BeamSearchParams, SamplingParams

if TYPE_CHECKING:
    from shardserve.engine.llm_engine import PromptType
    from shardserve.entrypoints.llm import LLM

logger = logging.getLogger(__name__)


@dataclass
class BeamSearchSequence:
    """One beam: `tokens` holds the prompt and the generated tokens (an ending EOS included),
    `logprobs` one dict per generated token (the candidates of that step), `text` the decoded
    `tokens` (prompt included, as vLLM's)."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None  # "stop" (EOS) or "length"
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    """A prompt's best sequences, best first (at most beam_width of them)."""

    sequences: list[BeamSearchSequence]


def beam_search_score(tokens: Sequence[int], cum_logprob: float, eos_token_id: int | None,
                      length_penalty: float = 1.0) -> float:
    """vLLM's ranking: cum_logprob / length ** length_penalty, the length counting the prompt
    and the generated tokens but not an ending EOS."""
    length = len(tokens)
    if eos_token_id is not None and tokens and tokens[-1] == eos_token_id:
        length -= 1
    return cum_logprob / (length ** length_penalty)


@dataclass
class _Prompt:
    """One prompt's search: its live beams and those set aside as finished."""

    beams: list[BeamSearchSequence]
    room: int  # tokens the prompt may still grow by (max_tokens, bounded by max_model_len)
    done: list[BeamSearchSequence] = field(default_factory=list)


class BeamSearch:
    """The search over several prompts' token ids, one step at a time: `requests()` gives the
    token ids of every live beam (one engine request each, with `step_params`), `advance()`
    takes their outputs in that order; `done` once no beam lives; then `results()`."""

    def __init__(self, prompts: Sequence[list[int]], params: BeamSearchParams,
                 eos_token_id: int | None, max_model_len: int) -> None:
        self.params = params
        self.eos_token_id = eos_token_id
        self._prompts = [_Prompt([BeamSearchSequence(list(ids))],
                                 min(params.max_tokens, max_model_len - len(ids)))
                         for ids in prompts]
        # One token per beam, its top 2 * beam_width logprobs (the sampled one comes too).
        self.step_params = SamplingParams(max_tokens=1, logprobs=2 * params.beam_width,
                                          temperature=params.temperature, ignore_eos=True)
        for p in self._prompts:
            self._retire_if_full(p)

    def score(self, beam: BeamSearchSequence) -> float:
        return beam_search_score(beam.tokens, beam.cum_logprob, self.eos_token_id,
                                 self.params.length_penalty)

    @property
    def done(self) -> bool:
        return not any(p.beams for p in self._prompts)

    def requests(self) -> list[list[int]]:
        """The token ids of every live beam, prompt by prompt."""
        return [beam.tokens for p in self._prompts for beam in p.beams]

    def advance(self, outputs: Sequence[RequestOutput]) -> None:
        """One step: `outputs` answer requests() in order (each with its token's logprobs)."""
        it = iter(outputs)
        for p in self._prompts:
            candidates: list[BeamSearchSequence] = []
            for beam in p.beams:
                candidates += self._extend(p, beam, _step_logprobs(next(it)))
            candidates.sort(key=self.score, reverse=True)
            p.beams = candidates[:self.params.beam_width]
            p.room -= 1
            self._retire_if_full(p)

    def _extend(self, p: _Prompt, beam: BeamSearchSequence,
                logprobs: dict[int, Logprob]) -> list[BeamSearchSequence]:
        """beam's candidates (one per token in logprobs); those ending in EOS go to p.done."""
        live = []
        for token, lp in logprobs.items():
            child = BeamSearchSequence(beam.tokens + [token], beam.logprobs + [logprobs],
                                       beam.cum_logprob + lp.logprob)
            if token == self.eos_token_id and not self.params.ignore_eos:
                child.finish_reason = "stop"
                p.done.append(child)
            else:
                live.append(child)
        return live

    def _retire_if_full(self, p: _Prompt) -> None:
        """Beams that may not grow any more (max_tokens, or max_model_len) are finished."""
        if p.room > 0:
            return
        for beam in p.beams:
            beam.finish_reason = "length"
        p.done += p.beams
        p.beams = []

    def results(self, decode: Callable[[list[int]], str] | None = None
                ) -> list[BeamSearchOutput]:
        """Each prompt's best beam_width sequences, best first (their text decoded, with
        `decode`)."""
        outputs = []
        for p in self._prompts:
            best = sorted(p.done + p.beams, key=self.score, reverse=True)
            best = best[:self.params.beam_width]
            for beam in best if decode is not None else ():
                beam.text = decode(beam.tokens)
            outputs.append(BeamSearchOutput(best))
        return outputs


def _step_logprobs(out: RequestOutput) -> dict[int, Logprob]:
    """The one generated token's logprobs dict (the sampled token and the top-N)."""
    logprobs = out.outputs[0].logprobs
    if not logprobs:
        raise RuntimeError(f"beam search request {out.request_id} returned no logprobs")
    return logprobs[0]


def warn_without_prefix_caching(enabled: bool) -> None:
    if not enabled:
        logger.warning("beam search without prefix caching: every beam recomputes its whole "
                       "prefix each step and holds its own copy of the prompt's KV blocks "
                       "(enable_prefix_caching=True shares them)")


def run_beam_search(llm: LLM, prompts: Sequence[PromptType], params: BeamSearchParams,
                    use_tqdm: bool = False) -> list[BeamSearchOutput]:
    """LLM.beam_search: the search driven through LLM.generate, one batch per step."""
    if not isinstance(params, BeamSearchParams):
        raise ValueError(f"params must be a BeamSearchParams, got {type(params).__name__}")
    ids = [llm.engine.process_prompt(p)[1] for p in prompts]
    config = llm.config
    warn_without_prefix_caching(config.cache_config.enable_prefix_caching)
    tokenizer = llm.get_tokenizer()
    search = BeamSearch(ids, params, tokenizer.eos_token_id, config.model_config.max_model_len)
    steps = range(params.max_tokens)
    for _ in (_progress(steps) if use_tqdm else steps):
        if search.done:
            break
        batch = [{"prompt_token_ids": tokens} for tokens in search.requests()]
        search.advance(llm.generate(batch, search.step_params, use_tqdm=False))
    return search.results(tokenizer.decode)


def _progress(steps: range):
    from tqdm import tqdm

    return tqdm(steps, desc="Beam search", unit="token", dynamic_ncols=True)
