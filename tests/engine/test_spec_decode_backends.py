"""Speculative decoding with everything else (spec_cases.py's workloads on the echo model):
the same outputs as without speculation, synchronous and asynchronous, under preemption, on mp
with TP=3 and with two pipeline stages, with drafts accepted in every group (structured outputs
included: a constrained request verifies only drafts its grammar accepts, each position under
its own bitmask row). Prefix caching is on throughout (every greedy case shares a prompt with a
sampled one)."""

from __future__ import annotations

import copy
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from shardserve import LLM, SamplingParams
from shardserve.engine.core_wire import SchedulerStats, scheduler_stats
from shardserve.engine.spec_decode_scheduling import spec_decode_line
from shardserve.entrypoints.server.metrics import ServerMetrics
from shardserve.executor.start_method import _why_fork_is_unsafe
from shardserve.model import native_kernels

sys.path.insert(0, str(Path(__file__).parent))
from spec_cases import NGRAM, PROMPTS, run_all_cases, run_cases  # noqa: E402

K = 3


def _engine(model: Path, **options) -> LLM:
    return LLM(str(model), **{"dtype": "float32", "max_model_len": 256, "seed": 0,
                              "speculative_config": NGRAM, **options})


def _shutdown(llm: LLM) -> None:
    """Shut down, and wait (bounded) until nothing in this process would make mp start its
    workers by spawn (seconds slower than fork): the grammar pool's thread stays, idle, which
    does not count (shardserve/idle_threads.py)."""
    llm.shutdown()
    deadline = time.monotonic() + 10
    while _why_fork_is_unsafe() is not None and time.monotonic() < deadline:
        time.sleep(0.01)


@pytest.fixture(scope="module")
def sync_runs(echo_model) -> tuple[dict[str, list[tuple]], tuple, dict[str, int], Any]:
    """The synchronous engine: without speculation (no drafts verified: the reference), with
    it, the drafts each group accepts on its own, and its figures then (get_metrics, the
    counters of the scheduler and of the core's stats message)."""
    llm = _engine(echo_model, async_scheduling=False)
    try:
        reference, accepted = run_cases(llm, k=0)
        assert not accepted
        with_spec = run_cases(llm, k=K)
        alone = {name: run_cases(llm, k=K, groups=(name,))[1] for name in reference}
        core = llm.engine.core
        figures = (llm.get_metrics(), copy.deepcopy(core.scheduler.spec.stats),
                   scheduler_stats(core))
        return reference, with_spec, alone, figures
    finally:
        _shutdown(llm)


@pytest.fixture(scope="module")
def reference(sync_runs) -> dict[str, list[tuple]]:
    return sync_runs[0]


def _check(llm: LLM, reference: dict[str, list[tuple]]) -> int:
    """The outputs equal the reference's; returns the drafts verified in steps the workers
    filled in themselves (asynchronous scheduling: SchedulerOutput.draft_slots)."""
    filled = _count_filled_drafts(llm)
    _check_runs(run_cases(llm, k=K), reference)
    return filled[0]


def _count_filled_drafts(llm: LLM) -> list[int]:
    """A spy on the scheduler's fold: the drafts the workers verified in draft slots."""
    scheduler = llm.engine.core.scheduler
    fold, filled = scheduler.update_from_output, [0]

    def counted(so, out):
        if so.draft_slots and out.num_drafts is not None:
            filled[0] += sum(int(n) for rid, n in zip(out.req_ids, out.num_drafts, strict=True)
                             if rid in so.draft_slots)
        return fold(so, out)

    scheduler.update_from_output = counted
    return filled


def _check_runs(runs: tuple[dict[str, list[tuple]], int], reference: dict) -> None:
    results, accepted = runs
    assert results == reference
    assert accepted > 0  # drafts were really verified


def test_sync_identical(sync_runs):
    reference, with_spec, alone, _ = sync_runs
    _check_runs(with_spec, reference)
    assert all(alone.values()), alone  # every group on its own verifies drafts
    for _, text, reason in reference["structured"]:
        assert reason == "stop", text


def test_metrics(sync_runs):
    """LLM.get_metrics(), /metrics (vLLM's spec_decode counters under our prefix) and the
    periodic stats line report the scheduler's counts."""
    metrics, stats, wire = sync_runs[3]
    assert stats.num_drafts > 0 and 0 < stats.num_accepted_tokens <= stats.num_draft_tokens
    assert sum(stats.accepted_per_pos) == stats.num_accepted_tokens
    assert stats.accepted_per_pos == sorted(stats.accepted_per_pos, reverse=True)
    assert metrics["spec_decode_num_drafts"] == stats.num_drafts
    assert metrics["spec_decode_num_draft_tokens"] == stats.num_draft_tokens
    assert metrics["spec_decode_num_accepted_tokens"] == stats.num_accepted_tokens
    assert metrics["spec_decode_num_accepted_tokens_per_pos"] == stats.accepted_per_pos
    assert metrics["spec_decode_mean_acceptance_length"] == pytest.approx(
        1 + stats.num_accepted_tokens / stats.num_drafts)
    server = ServerMetrics()
    server.on_stats(0, SchedulerStats())
    server.on_stats(0, wire)
    text = server.render().decode()
    assert f"shardserve:spec_decode_num_drafts_total {float(stats.num_drafts)}" in text
    assert f"shardserve:spec_decode_num_accepted_tokens_total " \
        f"{float(stats.num_accepted_tokens)}" in text
    assert f'shardserve:spec_decode_num_accepted_tokens_per_pos_total{{position="0"}} ' \
        f"{float(stats.accepted_per_pos[0])}" in text
    line, _ = spec_decode_line(wire, SchedulerStats())
    assert f"Accepted: {stats.num_accepted_tokens} tokens, Drafted: " \
        f"{stats.num_draft_tokens} tokens" in line
    assert spec_decode_line(wire, wire)[0] is None  # nothing verified since


def test_suffix_identical(echo_model, reference):
    """Suffix decoding (worker/spec_decode/suffix_tree.py) proposes through the same path."""
    suffix = {"method": "suffix", "num_speculative_tokens": K, "max_batch_for_speculation": 64,
              "min_acceptance_rate": 0.0, "max_verify_rows": 0}
    llm = _engine(echo_model, async_scheduling=False, speculative_config=suffix)
    try:
        _check(llm, reference)
    finally:
        _shutdown(llm)


def test_async_identical(echo_model, reference):
    """Two steps in flight: a speculating request's next step verifies the drafts the workers
    proposed after its step in flight, placed by them (draft slots)."""
    llm = _engine(echo_model)
    try:
        assert _check(llm, reference) > 0
    finally:
        _shutdown(llm)


def test_preemption_identical(echo_model, reference):
    """A cache of 8 blocks of 16 tokens for requests of up to ~70: some are preempted (and
    recomputed) while others verify drafts; no draft costs a preemption."""
    llm = _engine(echo_model, num_blocks_override=8, max_model_len=96, max_num_batched_tokens=48)
    try:
        _check(llm, reference)
        assert llm.engine.core.scheduler.total_preemptions > 0
    finally:
        _shutdown(llm)


@pytest.mark.parametrize("layout", [{"tensor_parallel_size": 3}, {"pipeline_parallel_size": 2}],
                         ids=["tp3", "pp2"])
def test_mp_identical(echo_model, reference, layout):
    llm = _engine(echo_model, distributed_executor_backend="mp", **layout)
    try:
        filled = _check(llm, reference)
        # TP: every rank proposes and fills its slots alike; stages wait for their tokens.
        assert (filled > 0) == ("tensor_parallel_size" in layout), filled
    finally:
        _shutdown(llm)


def test_dp2_identical(echo_model, reference):
    """data_parallel_size=2: each replica's engine core (a process of its own) proposes and
    verifies for the requests routed to it; both verify drafts, outputs as without."""
    llm = _engine(echo_model, data_parallel_size=2, async_scheduling=False,
                  speculative_config={**NGRAM, "num_speculative_tokens": K})
    try:
        results, accepted = run_all_cases(llm)
        assert results == reference
        assert len(accepted) == 2 and all(n > 0 for n in accepted), accepted
    finally:
        _shutdown(llm)


def test_never_slower_gates(echo_model):
    """Above max_batch_for_speculation running requests nothing is drafted (the workers
    propose nothing); a request whose drafts are rejected stops verifying drafts for
    speculation_backoff_steps steps, the others go on."""
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    rejected, accepted = {"prompt_token_ids": PROMPTS[2]}, {"prompt_token_ids": PROMPTS[0]}
    llm = _engine(echo_model, async_scheduling=False,
                  speculative_config={**NGRAM, "max_batch_for_speculation": 2,
                                      "min_acceptance_rate": 1.0,
                                      "speculation_backoff_steps": 1000})
    try:
        stats = llm.engine.core.scheduler.spec.stats
        llm.generate([accepted] * 3, greedy, use_tqdm=False)
        assert stats.num_drafts == 0  # 3 running > 2
        llm.generate([rejected], greedy, use_tqdm=False)
        assert stats.num_drafts == 1 and stats.num_accepted_tokens == 0  # then paused
        llm.generate([accepted], greedy, use_tqdm=False)
        assert stats.num_drafts > 2 and stats.num_accepted_tokens > 10  # all accepted: on
    finally:
        _shutdown(llm)


def test_drafts_share_the_steps_verify_rows(echo_model):
    """max_verify_rows caps a step's rows, drafts included, shared among its requests: 4
    running under a cap of 8 verify one draft each a step (4 + 4 rows); alone, a request takes
    up to k."""
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    accepted = {"prompt_token_ids": PROMPTS[0]}
    llm = _engine(echo_model, async_scheduling=False,
                  speculative_config={**NGRAM, "max_verify_rows": 8})
    try:
        stats = llm.engine.core.scheduler.spec.stats
        llm.generate([accepted] * 4, greedy, use_tqdm=False)
        assert stats.num_drafts > 8 and stats.num_draft_tokens == stats.num_drafts
        before = stats.num_draft_tokens, stats.num_drafts
        llm.generate([accepted], greedy, use_tqdm=False)
        drafted, steps = stats.num_draft_tokens - before[0], stats.num_drafts - before[1]
        assert steps > 0 and drafted > steps  # up to k = 3 each
    finally:
        _shutdown(llm)


@pytest.mark.skipif(not native_kernels.compiler_available(), reason="no C compiler")
def test_fused_decode_verifies_bit_identically(echo_model, monkeypatch):
    """With quantized weights (int8, bfloat16 activations) a request alone runs each decode
    through the fused C stack (model/fused_decode.py); its verify steps of 2-3 positions run
    there too, as decode rows, and give the tokens of decoding one at a time."""
    from shardserve.model.fused_decode import FusedDecode

    rows: list[int] = []
    run = FusedDecode.run
    monkeypatch.setattr(FusedDecode, "run", lambda self, x, *args: (rows.append(len(x)),
                                                                        run(self, x, *args))[1])
    llm = _engine(echo_model, dtype="bfloat16", quantization="int8", async_scheduling=False,
                  speculative_config={**NGRAM, "num_speculative_tokens": 2})
    try:
        runs = {}
        for k in (0, 2):
            llm.engine.core.scheduler.spec.k = k
            runs[k] = [llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0]
                       .outputs[0].token_ids for p in PROMPTS
                       for params in (SamplingParams(max_tokens=24, temperature=0),
                                      SamplingParams(max_tokens=24, temperature=1.0, seed=1))]
            assert set(rows) == ({1} if k == 0 else {1, 2, 3}), k
            rows.clear()
        assert runs[2] == runs[0]
        assert llm.engine.core.scheduler.spec.stats.num_accepted_tokens > 20
    finally:
        _shutdown(llm)
