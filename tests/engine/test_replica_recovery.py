"""Replica recovery's parts (engine/replica_recovery.py) and the offline engine's restart:

- the restart bound over its window and the backoff (a clock of the test's);
- a request continued from the tokens it produced equals the uninterrupted request, token for
  token: greedy, seeded sampling (top-p), a penalty and a JSON grammar — what makes a moved
  request exact, checked on a real engine core;
- `LLM(max_engine_restarts=1)`: a worker SIGKILLed mid-generate (mp, TP=2) is healed and every
  output equals an engine that never died; a request that kills every engine it reaches ends
  with finish_reason "abort" after max_request_migrations while the others complete.
"""

from __future__ import annotations

import pytest

from shardserve import LLM, SamplingParams
from shardserve.config.recovery import RecoveryConfig
from shardserve.engine.input_processor import EngineCoreRequest
from shardserve.engine.replica_recovery import RestartBudget, resumed
from shardserve.errors import EngineDeadError

PROMPTS = ["The quick brown fox", "Once upon a time", "1, 2, 3,", "Hello"]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_restart_budget_counts_within_its_window_and_backs_off():
    clock = Clock()
    budget = RestartBudget(2, 60.0, clock)
    assert budget.take() and budget.backoff_s() == 0.0
    clock.now = 10
    assert budget.take() and budget.backoff_s() == 0.5
    assert not budget.take()  # a third within 60 s
    clock.now = 61  # the first is out of the window
    assert budget.take()
    assert not RestartBudget(0, 60.0, clock).take()


def test_recovery_options_are_checked():
    for bad in ({"max_engine_restarts": -1}, {"max_request_migrations": -1},
                {"engine_restart_window_s": 0}, {"engine_restart_timeout_s": 0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            RecoveryConfig(**bad)


def test_resumed_request_carries_its_tokens_and_no_second_prompt_logprobs():
    request = EngineCoreRequest("r", [1, 2, 3], SamplingParams(prompt_logprobs=2))
    moved = resumed(request, [7, 8])
    assert moved.output_token_ids == (7, 8) and moved.sampling_params.prompt_logprobs is None
    assert resumed(request, []).sampling_params.prompt_logprobs == 2  # nothing served yet


def _run(core, request: EngineCoreRequest) -> list[int]:
    core.add_request(request.to_request())
    tokens = []
    while core.has_unfinished_requests():
        for out in core.step():
            tokens += out.new_token_ids
    return tokens


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
    SamplingParams(temperature=1.0, top_p=0.9, seed=11, max_tokens=40, ignore_eos=True),
    SamplingParams(temperature=0.8, seed=5, max_tokens=40, ignore_eos=True,
                   repetition_penalty=1.3),
], ids=["greedy", "seeded-top-p", "seeded-penalty"])
def test_a_request_continued_from_its_tokens_equals_the_whole(tiny_llama_dir, params):
    llm = LLM(str(tiny_llama_dir), dtype="float32", max_model_len=256)
    try:
        core = llm.engine.core
        prompt = llm.engine.process_prompt("The quick brown fox")[1]
        whole = _run(core, EngineCoreRequest("a", prompt, params))
        assert len(whole) == 40
        for k in (1, 17, 39):
            rest = _run(core, EngineCoreRequest(f"b{k}", prompt, params,
                                                output_token_ids=tuple(whole[:k])))
            assert whole[:k] + rest == whole, k  # its budget is max_tokens minus the k
    finally:
        llm.shutdown()


def test_a_grammar_request_continues_from_its_tokens(tiny_llama_dir):
    from shardserve.sampling_params import StructuredOutputsParams

    llm = LLM(str(tiny_llama_dir), dtype="float32", max_model_len=256)
    try:
        core = llm.engine.core
        prompt = llm.engine.process_prompt("Answer:")[1]
        params = SamplingParams(temperature=1.0, seed=3, max_tokens=30, structured_outputs=
                                StructuredOutputsParams(regex=r"[a-z]{3,8}( [a-z]{3,8}){5,9}"))
        whole = _run(core, EngineCoreRequest("a", prompt, params, eos_token_ids=(0,)))
        rest = _run(core, EngineCoreRequest("b", prompt, params, eos_token_ids=(0,),
                                            output_token_ids=tuple(whole[:6])))
        assert whole[:6] + rest == whole
    finally:
        llm.shutdown()


def _params() -> list[SamplingParams]:
    return [SamplingParams(temperature=0, max_tokens=48, ignore_eos=True),
            SamplingParams(temperature=1.0, top_p=0.9, seed=21, max_tokens=48, ignore_eos=True),
            SamplingParams(temperature=0.7, seed=4, max_tokens=30, ignore_eos=True, n=2),
            SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)]


def _texts(outputs) -> list[list[list[int]]]:
    return [[list(c.token_ids) for c in o.outputs] for o in outputs]


def test_llm_heals_a_killed_worker_and_every_output_is_unchanged(tiny_llama_dir, tmp_path,
                                                                 monkeypatch):
    reference = LLM(str(tiny_llama_dir), dtype="float32", max_model_len=256)
    try:
        expected = _texts(reference.generate(PROMPTS, _params(), use_tqdm=False))
    finally:
        reference.shutdown()
    monkeypatch.setenv("SHARDSERVE_TEST_DIE_ONCE", str(tmp_path / "died"))
    llm = LLM(str(tiny_llama_dir), dtype="float32", max_model_len=256, tensor_parallel_size=2,
              distributed_executor_backend="mp", worker_cls="suicidal_worker.SuicidalWorker",
              max_engine_restarts=1)
    try:
        assert _texts(llm.generate(PROMPTS, _params(), use_tqdm=False)) == expected
        assert (tmp_path / "died").exists() and llm.engine.restart.restarts == 1
    finally:
        llm.shutdown()


def test_a_request_that_kills_engines_is_given_up_and_the_others_finish(tiny_llama_dir):
    from suicidal_worker import POISON_SEED

    llm = LLM(str(tiny_llama_dir), dtype="float32", max_model_len=256,
              worker_cls="suicidal_worker.SuicidalWorker", distributed_executor_backend="mp",
              max_engine_restarts=5, max_request_migrations=1)
    try:
        ok = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
        poison = SamplingParams(temperature=0.5, seed=POISON_SEED, max_tokens=16)
        outputs = llm.generate(PROMPTS[:3], [ok, poison, ok], use_tqdm=False)
        assert [o.outputs[0].finish_reason for o in outputs] == ["length", "abort", "length"]
        assert llm.engine.restart.restarts == 2  # isolated at the 1st death, given up at the 2nd
    finally:
        llm.shutdown()
    off = LLM(str(tiny_llama_dir), dtype="float32", max_model_len=256,
              worker_cls="suicidal_worker.SuicidalWorker", distributed_executor_backend="mp")
    try:  # restarts are off by default offline: the death is the caller's error
        with pytest.raises(EngineDeadError):
            off.generate(PROMPTS[:1], SamplingParams(seed=POISON_SEED), use_tqdm=False)
    finally:
        off.shutdown()


def test_ledger_isolates_a_poison_request_and_charges_no_request_that_progressed():
    from shardserve.engine.migration_ledger import MigrationLedger

    ledger, tokens = MigrationLedger(1), {"a": 0, "p": 0, "b": 5}
    for rid in tokens:
        ledger.sent(rid, 0)
    # A death before a or p made progress: both are suspects; b had progressed and moves on.
    assert ledger.on_death(["a", "p", "b"], tokens.get) == ([], ["b"])
    ledger.sent("b", 5)
    assert ledger.release(tokens.get) == "a"  # one at a time, on probation
    assert ledger.release(tokens.get) is None  # a has produced nothing yet
    tokens["a"] = 1
    assert ledger.release(tokens.get) == "p"
    ledger.sent("p", 0)
    # p on probation dies: charged alone (a and b are moved although b stalled meanwhile).
    assert ledger.on_death(["a", "p", "b"], tokens.get) == (["p"], ["a", "b"])
    assert ledger.strikes["a"] == 1 and ledger.strikes["b"] == 0 and not ledger.suspects
    # A later death with a and b both making progress charges nobody.
    ledger.sent("a", 1)
    tokens.update(a=3, b=9)
    assert ledger.on_death(["a", "b"], tokens.get) == ([], ["a", "b"])


def test_ledger_releases_the_next_suspect_when_the_one_on_probation_ends():
    from shardserve.engine.migration_ledger import MigrationLedger

    ledger, tokens = MigrationLedger(2), {"a": 0, "b": 0}
    for rid in tokens:
        ledger.sent(rid, 0)
    assert ledger.on_death(["a", "b"], tokens.get) == ([], [])  # both held
    assert ledger.release(tokens.get) == "a"
    ledger.forget("a")  # it ended at its first output (max_tokens=1), or its client left
    assert ledger.release(tokens.get) == "b"  # not held for ever
