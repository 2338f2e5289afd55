"""Beam search over the engine's ordinary requests, at the LLM level as vLLM v1 runs it, with
the ranking and stopping rules of HF transformers' `_beam_search` (early_stopping=False).

Each step, every live beam of every prompt is one engine request, all submitted as one batch:
its prompt is the beam's tokens so far, it generates ONE token and returns the top
2 * beam_width logprobs (plus the sampled token's). Every candidate (beam + token) gets the
beam's cumulative logprob plus the token's. Then, per prompt, as HF does:

- the 2 * beam_width best candidates by cum_logprob are the step's top (each beam's own top
  2 * beam_width tokens hold them all, so one request per beam sees what HF's top-k over
  beams x vocabulary sees);
- of the top beam_width of those, each ending in EOS (unless ignore_eos), and at the last step
  every one, is a finished sequence; the beam_width best finished by score are kept;
- the best beam_width of the top that do not end in EOS live on;
- the prompt stops early once beam_width sequences are finished and the best live beam's score
  at its current length is no better than the worst finished one's;
- its result: the finished sequences, best first by

    score = cum_logprob / generated_len ** length_penalty   (generated_len: the generated
                                                            tokens, an ending EOS counted)

Why HF's rules and not vLLM v1's: vLLM's LLM.beam_search sets aside every EOS candidate of
each beam's top 2 * beam_width, never stops early, and ranks by
cum_logprob / (prompt_len + generated_len - an ending EOS) ** length_penalty; counting the
prompt favours short EOS-ended candidates on long prompts ("The capital of France is" ->
"Paris.<EOS>" on the default model, which HF never keeps: not in its step's top 3). Both agree
whenever no EOS is involved (ignore_eos): the same live beams, the same final beam_width, in the
same order. HF's is the reference the acceptance tests check token for token; one rule, no
option: vLLM's BeamSearchParams has no field choosing it, and `score` is never returned.

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


def beam_search_score(num_generated: int, cum_logprob: float,
                      length_penalty: float = 1.0) -> float:
    """HF's ranking: cum_logprob / generated_len ** length_penalty, the generated length with
    an ending EOS counted and the prompt not (a sequence with nothing generated: its
    cum_logprob, 0)."""
    if num_generated <= 0:
        return cum_logprob
    return cum_logprob / (num_generated ** length_penalty)


@dataclass
class _Prompt:
    """One prompt's search: its live beams (best first) and its finished sequences (best first,
    at most beam_width)."""

    beams: list[BeamSearchSequence]
    prompt_len: int
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
        self._prompts = [_Prompt([BeamSearchSequence(list(ids))], len(ids),
                                 min(params.max_tokens, max_model_len - len(ids)))
                         for ids in prompts]
        # One token per beam, its top 2 * beam_width logprobs (the sampled one comes too).
        self.step_params = SamplingParams(max_tokens=1, logprobs=2 * params.beam_width,
                                          temperature=params.temperature, ignore_eos=True)
        for p in self._prompts:
            if p.room <= 0:  # no room to generate: the prompt itself is the one result
                p.beams[0].finish_reason = "length"
                p.done, p.beams = p.beams, []

    def score(self, p: _Prompt, beam: BeamSearchSequence) -> float:
        return beam_search_score(len(beam.tokens) - p.prompt_len, beam.cum_logprob,
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
            if not p.beams:
                continue
            candidates: list[BeamSearchSequence] = []
            for beam in p.beams:
                logprobs = _step_logprobs(next(it))
                candidates += [BeamSearchSequence(beam.tokens + [token],
                                                  beam.logprobs + [logprobs],
                                                  beam.cum_logprob + lp.logprob)
                               for token, lp in logprobs.items()]
            self._step(p, candidates)

    def _ends(self, beam: BeamSearchSequence) -> bool:
        return not self.params.ignore_eos and beam.tokens[-1] == self.eos_token_id

    def _step(self, p: _Prompt, candidates: list[BeamSearchSequence]) -> None:
        """HF's step (see the module docstring): finish, keep the live beams, maybe stop."""
        width = self.params.beam_width
        # Stable sorts: of equal cum_logprobs the earlier beam's candidate comes first.
        top = sorted(candidates, key=lambda c: c.cum_logprob, reverse=True)[:2 * width]
        p.room -= 1
        last = p.room <= 0
        for child in top[:width]:
            if self._ends(child):
                child.finish_reason = "stop"
            elif last:
                child.finish_reason = "length"
            else:
                continue
            p.done.append(child)
        p.done = sorted(p.done, key=lambda b: self.score(p, b), reverse=True)[:width]
        p.beams = [] if last else [c for c in top if not self._ends(c)][:width]
        if p.beams and self._cannot_improve(p):
            p.beams = []

    def _cannot_improve(self, p: _Prompt) -> bool:
        """HF's early stop (early_stopping=False): beam_width sequences finished and the best
        live beam, scored at its current length, no better than the worst of them. A
        heuristic (a live beam's score may still rise), kept for equality with HF."""
        if len(p.done) < self.params.beam_width:
            return False
        return self.score(p, p.beams[0]) <= self.score(p, p.done[-1])

    def results(self, decode: Callable[[list[int]], str] | None = None
                ) -> list[BeamSearchOutput]:
        """Each prompt's best beam_width finished sequences, best first (their text decoded,
        with `decode`); once `done`."""
        outputs = []
        for p in self._prompts:
            for beam in p.done if decode is not None else ():
                beam.text = decode(beam.tokens)
            outputs.append(BeamSearchOutput(list(p.done)))
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
