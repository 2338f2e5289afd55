"""Context parallelism on mp: decode context parallel (the KV cache sharded by position over TP
ranks) and prefill context parallel (a prompt split over ranks): float32 greedy equals HF
transformers on the default model (chunked prefill of a long prompt:
test_context_parallel_chunked.py), the KV memory a 1-KV-head model saves, DP replicas with
structured outputs, and a killed rank of a context group failing the engine fast."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from shardserve import LLM, EngineDeadError, SamplingParams
from tests.conftest import TP3  # heads that split three ways

sys.path.insert(0, str(Path(__file__).parents[1] / "entrypoints"))
sys.path.insert(0, str(Path(__file__).parent))
from fault_helpers import generate_until_dead  # noqa: E402
from greedy_cases import PROMPTS, greedy_tokens  # noqa: E402
from pp_oracle import assert_matches_hf  # noqa: E402

LAYOUTS = {
    "tp3-dcp3": dict(tensor_parallel_size=3, decode_context_parallel_size=3),
    "pcp2": dict(prefill_context_parallel_size=2),
        "pcp2-pp2": dict(prefill_context_parallel_size=2, pipeline_parallel_size=2),
    "pcp2-dcp2": dict(prefill_context_parallel_size=2, decode_context_parallel_size=2),
}


def _collective_paths(worker) -> dict[str, tuple[int, int]]:
    from shardserve.distributed.parallel_state import get_dcp_group, get_pcp_group

    return {name: (g.shm_calls, g.fallback_calls)
            for name, g in (("pcp", get_pcp_group()), ("dcp", get_dcp_group()))}


@pytest.mark.slow
@pytest.mark.parametrize(("layout", "async_on"),
                         [("tp3-dcp3", True), ("pcp2-pp2", True)],
                         ids=["tp3-dcp3-async", "pcp2-pp2-async"])
# PCP=2 (sync) on these 8 prompts beside a 2,000-token one, and PCP=2 x DCP=2:
# test_context_parallel_chunked.py; PCP=3 (three shards) on the tiny model against HF:
# test_tiny_model_context_shards_match_hf[pcp3] below.
def test_default_model_matches_hf(hf_default_greedy, layout, async_on):
    llm = LLM(dtype="float32", max_model_len=512, distributed_executor_backend="mp",
              async_scheduling=async_on, **LAYOUTS[layout])  # fmt: skip
    try:
        assert_matches_hf(llm, hf_default_greedy)
        paths = llm.collective_rpc(_collective_paths)
        for kind in ("dcp", "pcp"):
            if kind in layout:  # its collectives ran, through shared memory
                assert all(p[kind][0] > 0 and p[kind][1] == 0 for p in paths), paths
    finally:
        llm.shutdown()


@pytest.mark.parametrize(("tp", "pcp"), [(3, 2), (1, 3)], ids=["tp3-pcp2", "pcp3"])
def test_tiny_model_context_shards_match_hf(tp3_model, tp, pcp):
    """Six ranks (PCP=2 x TP=3), and a prompt split three ways (PCP=3), on the tiny TP3-shape
    model (the default model at six ranks is too slow for the suite; PCP=3 on it took three
    default-model ranks for the split that PCP=2 checks there), prompts long enough to split:
    HF transformers' greedy tokens."""
    import transformers

    from tests.hf_oracle import argmax_greedy

    llm = LLM(str(tp3_model), dtype="float32", max_model_len=128, seed=0,
              tensor_parallel_size=tp, prefill_context_parallel_size=pcp,
              distributed_executor_backend="mp")  # fmt: skip
    try:
        ids = [llm.get_tokenizer().encode(p) for p in PROMPTS]
        hf = transformers.AutoModelForCausalLM.from_pretrained(tp3_model).eval()
        assert greedy_tokens(llm) == argmax_greedy(hf, ids, 24)
        paths = llm.collective_rpc(_collective_paths)
        assert len(paths) == tp * pcp
        assert all(p["pcp"][0] > 0 for p in paths), paths  # the prompts were really split
    finally:
        llm.shutdown()


@pytest.mark.parametrize("dcp", [2, 4], ids=["dcp-over-pcp", "dcp-over-tp-x-pcp"])
def test_tp2_pcp2_sharded_kv_equals_uni(tiny_llama_dir, dcp):
    """TP=2 x PCP=2 with the KV cache sharded over the context shards (DCP=2) or over all four
    ranks (DCP=4: the TP group's heads joined too), prompts long enough to split."""
    want = _uni(tiny_llama_dir)
    llm = LLM(str(tiny_llama_dir), dtype="float32", max_model_len=128, seed=0,
              tensor_parallel_size=2, prefill_context_parallel_size=2,
              decode_context_parallel_size=dcp, distributed_executor_backend="mp")  # fmt: skip
    try:
        assert greedy_tokens(llm) == want
        paths = llm.collective_rpc(_collective_paths)
        assert all(p["pcp"][0] > 0 and p["dcp"][0] > 0 for p in paths), paths
        capacity = llm.get_metrics()["kv_cache_capacity_tokens"]
        assert capacity % (16 * dcp) == 0, capacity  # virtual blocks of block_size x DCP
    finally:
        llm.shutdown()


def _structured_and_greedy(llm: LLM) -> list[list[int]]:
    """Greedy on PROMPTS, then seeded random sampling under a regex and a choice."""
    from shardserve.sampling_params import StructuredOutputsParams as S

    specs = [S(regex=r"[a-c]{2,6}-\d{1,3}"), S(choice=["red", "green", "dark blue"])]
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=24, structured_outputs=spec)
              for i, spec in enumerate(specs * 2)]
    outs = llm.generate([f"Answer request {i} in the form asked:" for i in range(4)], params,
                        use_tqdm=False)
    return greedy_tokens(llm) + [list(o.outputs[0].token_ids) for o in outs]


def test_dp2_pcp2_structured_outputs_equal_uni(tp3_model):
    """Two replicas of PCP=2 (four ranks), structured outputs with seeded sampling: every
    rank of a context group samples the same tokens (their hidden states are synced)."""
    llm = LLM(str(tp3_model), dtype="float32", max_model_len=128, seed=0)
    try:
        want = _structured_and_greedy(llm)
    finally:
        llm.shutdown()
    llm = LLM(str(tp3_model), dtype="float32", max_model_len=128, seed=0,
              data_parallel_size=2, prefill_context_parallel_size=2)  # fmt: skip
    try:
        assert _structured_and_greedy(llm) == want
        paths = llm.collective_rpc(_collective_paths)
        assert len(paths) == 4 and all(p["pcp"][0] > 0 for p in paths), paths
    finally:
        llm.shutdown()


def _uni(model: Path) -> list[list[int]]:
    llm = LLM(str(model), dtype="float32", max_model_len=128, seed=0)
    try:
        return greedy_tokens(llm)
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def tp3_model(tmp_path_factory, tiny_model_builder) -> Path:
    return tiny_model_builder("LlamaForCausalLM", tmp_path_factory.mktemp("cp_tp3"), **TP3)


def _kv_facts(worker) -> tuple[int, int]:
    runner = worker.model_runner
    return runner.kv_cache_block_bytes(), runner.kv_caches[0].shape[3]


def test_one_kv_head_dcp_halves_the_kv_per_token(tiny_model_builder, tmp_path):
    """1 KV head at TP=2: both ranks hold the same head; with DCP=2 each holds half the
    positions. Same bytes a block, twice the tokens a block, so twice the token capacity from
    the same memory; outputs equal uni."""
    model = tiny_model_builder("LlamaForCausalLM", tmp_path / "kv1", num_attention_heads=4,
                               num_key_value_heads=1)
    want = _uni(model)
    capacity = {}
    for dcp in (1, 2):
        llm = LLM(str(model), dtype="float32", max_model_len=128, seed=0,
                  tensor_parallel_size=2, decode_context_parallel_size=dcp,
                  kv_cache_memory_bytes=4 << 20, distributed_executor_backend="mp")  # fmt: skip
        try:
            assert greedy_tokens(llm) == want
            facts = llm.collective_rpc(_kv_facts)
            capacity[dcp] = (facts, llm.get_metrics()["kv_cache_capacity_tokens"])
        finally:
            llm.shutdown()
    (facts1, tokens1), (facts2, tokens2) = capacity[1], capacity[2]
    assert facts1 == facts2  # same bytes per block of block_size slots, one head
    assert tokens2 == 2 * tokens1, capacity


@pytest.mark.usefixtures("no_leftovers")
@pytest.mark.parametrize("layout", ["pcp2", "tp2-dcp2"])
def test_killed_rank_of_a_context_group_fails_fast(tiny_llama_dir, layout):
    sizes = (dict(prefill_context_parallel_size=2) if layout == "pcp2"
             else dict(tensor_parallel_size=2, decode_context_parallel_size=2))
    llm = LLM(str(tiny_llama_dir), dtype="float32", max_model_len=256,
              distributed_executor_backend="mp", **sizes)  # fmt: skip
    victim = llm.engine.core.executor.workers[1]
    try:
        killer = threading.Timer(0.5, os.kill, (victim.pid, signal.SIGKILL))
        killer.start()
        params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
        started = time.monotonic()
        with pytest.raises(EngineDeadError) as err:
            generate_until_dead(llm, PROMPTS, params)
        elapsed = time.monotonic() - started - 0.5
        print(f"{layout}: EngineDeadError {elapsed * 1000:.0f} ms after the kill")
        assert elapsed < 5.0  # the promise is 1 s; loose for a loaded 2-core machine
        where = "context shard 1" if layout == "pcp2" else "rank 1"
        for part in ("rank 1", where, "SIGKILL"):
            assert part in str(err.value), err.value
    finally:
        killer.cancel()
        llm.shutdown()
