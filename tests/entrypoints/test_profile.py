"""Profiling (worker/profiler.py): LLM.start_profile / stop_profile on mp TP=2 write one
Chrome trace per rank, named by its coordinates, and one for the engine core; each is JSON
with the model's C kernels named in it, and exactly the profiled steps."""

from __future__ import annotations

import json

import pytest

from shardserve import LLM, SamplingParams
from shardserve.model import native_kernels
from shardserve.worker.profiler import (
    ENGINE_STEP_LABEL,
    KERNEL_PREFIX,
    RANK_STEP_LABEL,
    ProfilerConfig,
)

# What every rank's trace must name: the kernels a tiny float32 Llama's steps call.
RANK_KERNELS = {"rms_norm", "rope_inplace", "cache_write", "decode_attention", "silu_mul"}


def _events(path: str) -> list[dict]:
    with open(path) as f:
        trace = json.load(f)  # parseable: what Perfetto reads
    return trace["traceEvents"]


def test_profile_five_steps_on_mp_tp2(tiny_llama_dir, tmp_path):
    plain_lib = native_kernels._lib
    llm = LLM(str(tiny_llama_dir), dtype="float32", tensor_parallel_size=2,
              distributed_executor_backend="mp", max_model_len=128,
              profiler_config={"profiler": "torch", "torch_profiler_dir": str(tmp_path)})
    try:
        with pytest.raises(RuntimeError, match="no profile is running; call start_profile"):
            llm.stop_profile()
        llm.start_profile()
        with pytest.raises(RuntimeError, match="already running; call stop_profile"):
            llm.start_profile()
        # One prompt, 5 tokens: 5 model steps (prefill, then 4 decodes).
        llm.generate(["the cat sat on"], SamplingParams(max_tokens=5, temperature=0,
                                                        ignore_eos=True), use_tqdm=False)
        paths = llm.stop_profile()
        assert native_kernels._lib is plain_lib  # nothing of the profiler left when it is off
        names = sorted(p.rsplit("/", 1)[1] for p in paths)
        assert names == ["trace_dp0_pp0_tp0.json", "trace_dp0_pp0_tp1.json",
                         "trace_engine_core_dp0.json"]
        for path in paths:
            events = _events(path)
            labels = [e.get("name", "") for e in events]
            if path.endswith("engine_core_dp0.json"):
                assert ENGINE_STEP_LABEL in labels
                continue
            assert labels.count(RANK_STEP_LABEL) == 5, path
            kernels = {n[len(KERNEL_PREFIX):] for n in labels if n.startswith(KERNEL_PREFIX)}
            assert RANK_KERNELS <= kernels, (path, kernels)
            assert any(n.startswith("aten::") for n in labels)  # torch's own ops beside them
        with pytest.raises(RuntimeError, match="no profile is running"):
            llm.stop_profile()
        llm.start_profile()  # a new profile after a stop
        assert llm.stop_profile()
    finally:
        llm.shutdown()


def test_profiler_config_forms_and_refusals(tmp_path):
    assert ProfilerConfig.parse(None) is None
    assert ProfilerConfig.parse(None, str(tmp_path)).torch_profiler_dir == str(tmp_path)
    parsed = ProfilerConfig.parse('{"profiler": "torch", "torch_profiler_dir": "/x", '
                                  '"torch_profiler_record_shapes": true}')
    assert parsed == ProfilerConfig("/x", torch_profiler_record_shapes=True)
    with pytest.raises(ValueError, match=r"keys \['delay'\] unknown; supported"):
        ProfilerConfig.parse({"torch_profiler_dir": "/x", "delay": 1})
    with pytest.raises(ValueError, match="not valid JSON"):
        ProfilerConfig.parse("{torch_profiler_dir: /x}")
    with pytest.raises(ValueError, match="needs torch_profiler_dir"):
        ProfilerConfig.parse({"profiler": "torch"})
    with pytest.raises(ValueError, match="profiler='cuda' is not supported"):
        ProfilerConfig.parse({"profiler": "cuda", "torch_profiler_dir": "/x"})


def test_context_shards_write_their_own_traces(tiny_llama_dir, tmp_path):
    """PCP=2: the two ranks share dp, pp and tp; the file names tell the context shards apart
    (both ranks' traces, each with its steps, not one overwriting the other)."""
    llm = LLM(str(tiny_llama_dir), dtype="float32", prefill_context_parallel_size=2,
              distributed_executor_backend="mp", max_model_len=128,
              profiler_config={"profiler": "torch", "torch_profiler_dir": str(tmp_path)})
    try:
        llm.start_profile()
        llm.generate(["the cat sat on the mat"], SamplingParams(max_tokens=3, temperature=0,
                                                                ignore_eos=True), use_tqdm=False)
        paths = llm.stop_profile()
    finally:
        llm.shutdown()
    names = sorted(p.rsplit("/", 1)[1] for p in paths)
    assert names == ["trace_dp0_pp0_pcp0_tp0.json", "trace_dp0_pp0_pcp1_tp0.json",
                     "trace_engine_core_dp0.json"]
    for path in [p for p in paths if "engine_core" not in p]:
        assert [e.get("name") for e in _events(path)].count(RANK_STEP_LABEL) == 3, path
