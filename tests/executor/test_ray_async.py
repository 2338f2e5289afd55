"""Asynchronous scheduling on the Ray backends: the same outputs as the synchronous engine on
every workload of tests/engine/async_cases.py, with TP=3 on ray_v2 and on the actor-call path of
`ray` (its two steps in flight travel as separate actor calls)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

sys.path.insert(0, str(Path(__file__).parents[1] / "engine"))
from async_cases import run_cases, stop_points  # noqa: E402

from shardserve import LLM  # noqa: E402

TP3 = dict(hidden_size=96, intermediate_size=192, num_attention_heads=6, num_key_value_heads=3)


@pytest.fixture(scope="module")
def tp3_model(tmp_path_factory, tiny_model_builder):
    return tiny_model_builder("LlamaForCausalLM", tmp_path_factory.mktemp("tp3_ray"), **TP3)


def _engine(model, **options) -> LLM:
    options = {"dtype": "float32", "max_model_len": 128, "seed": 0,
               "worker_start_timeout_s": 90, **options}  # fmt: skip
    return LLM(str(model), **options)


@pytest.fixture(scope="module")
def sync_results(tp3_model):
    llm = _engine(tp3_model, async_scheduling=False)
    try:
        tokens, stop_text = stop_points(llm)
        return tokens, stop_text, run_cases(llm, tokens, stop_text)
    finally:
        llm.shutdown()


@pytest.mark.parametrize(
    "options",
    [
        {"distributed_executor_backend": "ray_v2", "tensor_parallel_size": 3},
        {"distributed_executor_backend": "ray", "tensor_parallel_size": 3,
         "ray_use_compiled_graph": False},
    ],
    ids=["ray_v2-tp3", "ray-actors-tp3"],
)  # fmt: skip
def test_ray_async_equals_sync(ray_cluster, tp3_model, sync_results, options):
    tokens, stop_text, want = sync_results
    llm = _engine(tp3_model, **options)
    try:
        assert llm.engine.core.max_concurrent_batches == 2
        got = run_cases(llm, tokens, stop_text)
    finally:
        llm.shutdown()
    for case in want:
        assert got[case] == want[case], case


def test_structured_outputs_on_the_compiled_graph(ray_cluster, tp3_model):
    """The compiled graph sends a step whole (no early forward pass): a step whose bitmask
    waits for the previous step's tokens goes out once they are folded in; the constrained
    outputs equal the in-process engine's without async scheduling."""
    from test_structured_outputs import _run

    want = _run(tp3_model, async_scheduling=False)
    got = _run(tp3_model, distributed_executor_backend="ray", tensor_parallel_size=3,
               worker_start_timeout_s=90)
    assert got == want
