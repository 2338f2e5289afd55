"""Workloads that speculative decoding must not change, on conftest's echo model, shared by the
backend tests (test_spec_decode_backends.py).

`run_cases(llm, k)` runs every group of cases in one generate call with at most k drafts
verified a step (the scheduler's cap, `scheduler.spec.k`; 0: no speculation) and returns
comparable results and the drafts accepted (`run_all_cases(llm)`: the same at the engine's own
k, through the public API only, for engine cores in processes of their own): greedy
decoding, seeded sampling, stops that fire mid-draft, and structured outputs. The echo model
repeats tokens, so n-gram drafts of a repeat are accepted often and a stop often falls inside
a verified run.
"""

from __future__ import annotations

from typing import Any

from shardserve import LLM, SamplingParams
from shardserve.sampling_params import StructuredOutputsParams as S

ECHO = 66  # the echo model's p(66 | 66 ...) is 0.50
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3, "max_batch_for_speculation": 64, "min_acceptance_rate": 0.0,
         "max_verify_rows": 0}
PROMPTS = [[ECHO] * 8, [ECHO, 5, ECHO, 5, ECHO, 5], [7, 8, 9, 7, 8, 9, 7, 8], [285, 330, 91],
           [57] * 3 + [70] * 3]
SPECS = [S(regex=r"[a-c]{2,6}-\d{1,3}"), S(choice=["red", "green", "blue", "dark blue"]),
         S(json={"type": "object", "additionalProperties": False, "required": ["name"],
                 "properties": {"name": {"type": "string", "maxLength": 12}}},
           disable_any_whitespace=True)]


def _summary(outs: list[Any]) -> list[tuple]:
    return [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason)
            for o in outs]


def _stops(llm: LLM) -> list[tuple[list[int], SamplingParams]]:
    """Stops inside the greedy output of the first prompt (echo runs, so inside a verified
    run of drafts): a stop token after min_tokens, a stop string, max_tokens 2..11."""
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": PROMPTS[0]}], greedy, use_tqdm=False)[0].outputs[0]
    text, tokens = out.text, out.token_ids
    cases = [SamplingParams(max_tokens=24, temperature=0, min_tokens=5,
                            stop_token_ids=[tokens[6]]),
             SamplingParams(max_tokens=24, temperature=0, stop=[text[len(text) // 2:][:2]])]
    cases += [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (2, 5, 8, 11)]
    return [(PROMPTS[0], p) for p in cases]


def _groups(llm: LLM) -> dict[str, list[tuple[Any, SamplingParams]]]:
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    sampled = [SamplingParams(max_tokens=16, temperature=t, top_p=p, seed=s, ignore_eos=True,
                              repetition_penalty=r)
               for s, (t, p, r) in enumerate([(1.0, 0.9, 1.0), (0.7, 1.0, 1.0), (1.0, 1.0, 1.2)]
                                             * 2)]
    return {
        "greedy": [(p, greedy) for p in PROMPTS],
        "sampled": [(PROMPTS[i % len(PROMPTS)], p) for i, p in enumerate(sampled)],
        "stops": _stops(llm),
        "structured": [("Hello", SamplingParams(temperature=1.0, seed=i, max_tokens=60,
                                                 structured_outputs=SPECS[i % len(SPECS)]))
                       for i in range(6)],
    }


def run_cases(llm: LLM, k: int, groups: tuple[str, ...] | None = None
              ) -> tuple[dict[str, list[tuple]], int]:
    """Every group's outputs (or those of `groups`) from one generate call at a cap of k
    drafts a step, and the drafts accepted meanwhile."""
    spec = llm.engine.core.scheduler.spec
    spec.k = k
    chosen = {name: cases for name, cases in _groups(llm).items()
              if groups is None or name in groups}
    cases = [case for group in chosen.values() for case in group]
    prompts = [p if isinstance(p, str) else {"prompt_token_ids": p} for p, _ in cases]
    before = spec.stats.num_accepted_tokens
    outs = _summary(llm.generate(prompts, [p for _, p in cases], use_tqdm=False))
    results, start = {}, 0
    for name, group in chosen.items():
        results[name], start = outs[start:start + len(group)], start + len(group)
    return results, spec.stats.num_accepted_tokens - before


def run_all_cases(llm: LLM) -> tuple[dict[str, list[tuple]], list[int]]:
    """Every group's outputs from one generate call, and the drafts each data-parallel
    replica accepted meanwhile."""
    groups = _groups(llm)
    cases = [case for group in groups.values() for case in group]
    prompts = [p if isinstance(p, str) else {"prompt_token_ids": p} for p, _ in cases]
    before = [s.spec_num_accepted_tokens for s in llm.engine.client.stats()]
    outs = _summary(llm.generate(prompts, [p for _, p in cases], use_tqdm=False))
    after = [s.spec_num_accepted_tokens for s in llm.engine.client.stats()]
    results, start = {}, 0
    for name, group in groups.items():
        results[name], start = outs[start:start + len(group)], start + len(group)
    return results, [a - b for a, b in zip(after, before, strict=True)]
