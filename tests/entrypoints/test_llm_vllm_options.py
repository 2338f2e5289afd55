"""Options a vLLM user passes: a hub id found in the local Hugging Face cache (never a download;
a clear error naming the cache when absent), tokenizer_mode, and the GPU-only options accepted
on CPU with one log line each saying they do not apply."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys

import pytest
import torch

from shardserve import LLM, SamplingParams
from shardserve.config import engine as engine_config
from shardserve.engine.config_builder import engine_config_from_kwargs

SCRIPT = """
import sys
from shardserve import LLM, SamplingParams
llm = LLM("tiny-org/tiny-llama", dtype="float32", max_model_len=64)
out = llm.generate(["hello"], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
print("TOKENS", out[0].outputs[0].token_ids)
llm.shutdown()
"""


def _hub_cache(root, model_dir) -> None:
    """The layout huggingface_hub writes: models--org--name/{refs/main, snapshots/<commit>}."""
    repo = root / "models--tiny-org--tiny-llama"
    commit = "0123456789abcdef0123456789abcdef01234567"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    shutil.copytree(model_dir, repo / "snapshots" / commit)


def test_a_hub_id_loads_from_the_local_cache(tiny_llama_dir, tmp_path):
    _hub_cache(tmp_path / "hub", tiny_llama_dir)
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "0"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True,
                          text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "TOKENS [" in proc.stdout
    missing = subprocess.run([sys.executable, "-c", SCRIPT.replace("tiny-llama", "absent")],
                             env=env, capture_output=True, text=True, timeout=180)
    assert missing.returncode != 0
    assert "tiny-org/absent" in missing.stderr and str(tmp_path / "hub") in missing.stderr


def test_tokenizer_mode(tiny_llama_dir):
    assert engine_config_from_kwargs(str(tiny_llama_dir), tokenizer_mode="hf")
    with pytest.raises(ValueError, match="tokenizer_mode='mistral' is not supported"):
        engine_config_from_kwargs(str(tiny_llama_dir), tokenizer_mode="mistral")


def test_gpu_only_options_are_accepted_on_cpu_and_said_once(tiny_llama_dir, caplog):
    options = dict(dtype="float32", max_model_len=64, gpu_memory_utilization=0.85,
                   swap_space=4, enforce_eager=True, disable_log_stats=True,
                   trust_remote_code=False)
    engine_config._NOTED.clear()  # another test may have said them already
    with caplog.at_level(logging.INFO, logger="shardserve.config.engine"):
        llm = LLM(str(tiny_llama_dir), **options)
        llm.shutdown()
        engine_config_from_kwargs(str(tiny_llama_dir), **options)  # said once, not again
    said = [r.getMessage() for r in caplog.records if r.name == "shardserve.config.engine"]
    for words in ("gpu_memory_utilization=0.85 applies on CUDA only", "swap_space=4",
                  "enforce_eager=True changes nothing"):
        assert sum(words in m for m in said) == 1, (words, said)
    with pytest.raises(ValueError, match="gpu_memory_utilization=1.5"):
        engine_config_from_kwargs(str(tiny_llama_dir), gpu_memory_utilization=1.5)


def test_kv_cache_dtype_auto_and_bfloat16_are_honoured_and_others_refused(tiny_llama_dir):
    """vLLM's kv_cache_dtype: "auto" (its default, the cache in the model's dtype) and
    "bfloat16" run here; fp8 and the rest are refused with the value and the fix named, and
    bfloat16 with context parallelism (whose kernels read the cache in q's dtype) too."""
    for good in ("auto", "bfloat16"):
        assert engine_config_from_kwargs(str(tiny_llama_dir), kv_cache_dtype=good)
    for bad in ("fp8", "fp8_e5m2", "float16"):
        with pytest.raises(ValueError, match=f"kv_cache_dtype='{bad}' is not supported.*'auto'"):
            engine_config_from_kwargs(str(tiny_llama_dir), kv_cache_dtype=bad)
    with pytest.raises(ValueError, match="kv_cache_dtype='bfloat16' is not supported with "
                                         "context parallelism"):
        engine_config_from_kwargs(str(tiny_llama_dir), kv_cache_dtype="bfloat16",
                                  tensor_parallel_size=2, decode_context_parallel_size=2)


def _greedy_run(model_dir, kv_cache_dtype: str, quantization: str) -> tuple[list, list, int]:
    """Greedy tokens with their logprobs, the cache's dtype and its blocks for a fixed budget."""
    llm = LLM(str(model_dir), dtype="float32", max_model_len=256, kv_cache_dtype=kv_cache_dtype,
              kv_cache_memory_bytes=4 << 20, enable_prefix_caching=False,
              quantization=quantization)
    try:
        (dtype, blocks), = llm.collective_rpc(lambda w: (w.model_runner.kv_caches[0].dtype,
                                                         w.model_runner.kv_caches[0].shape[0]))
        params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=0)
        outs = llm.generate([[50, 357, 282, 17], [12, 99, 7] * 20, [300]], params,
                            use_tqdm=False)
        runs = [(o.outputs[0].token_ids,
                 [e[t].logprob for t, e in zip(o.outputs[0].token_ids, o.outputs[0].logprobs,
                                               strict=True)]) for o in outs]
    finally:
        llm.shutdown()
    return runs, dtype, blocks


@pytest.mark.parametrize("quantization", ["none", "int8"])
def test_kv_cache_dtype_bfloat16_halves_the_cache_and_keeps_the_outputs(tiny_llama_dir,
                                                                         quantization):
    """kv_cache_dtype="bfloat16" under a float32 model: the cache is bfloat16, so one budget
    holds twice the blocks, and decoding reads it (layer by layer, and with int8 weights in the
    fused decode step): each greedy token's logprob stays within bfloat16's rounding of K and V
    of the float32 cache's run, up to the first token where the two runs part."""
    auto, auto_dtype, auto_blocks = _greedy_run(tiny_llama_dir, "auto", quantization)
    half, half_dtype, half_blocks = _greedy_run(tiny_llama_dir, "bfloat16", quantization)
    assert (auto_dtype, half_dtype) == (torch.float32, torch.bfloat16)
    assert half_blocks == 2 * auto_blocks
    compared = 0
    for (tokens_a, lp_a), (tokens_b, lp_b) in zip(auto, half, strict=True):
        assert tokens_a[0] == tokens_b[0]  # the prompt's own K/V, unrounded, in both
        for ta, tb, a, b in zip(tokens_a, tokens_b, lp_a, lp_b, strict=True):
            if ta != tb:
                break
            assert abs(a - b) < 0.05, (a, b)
            compared += 1
    assert compared >= 24


def test_enable_sleep_mode_is_honoured(tiny_llama_dir):
    """vLLM's enable_sleep_mode: False refuses sleep() with the option named; True (like unset)
    sleeps and wakes, and the engine generates afterwards."""
    off = LLM(str(tiny_llama_dir), dtype="float32", max_model_len=64, enable_sleep_mode=False)
    try:
        with pytest.raises(RuntimeError, match="enable_sleep_mode=False"):
            off.sleep(level=1)
        assert off.generate(["hi"], use_tqdm=False)[0].outputs[0].token_ids  # still healthy
    finally:
        off.shutdown()
    on = LLM(str(tiny_llama_dir), dtype="float32", max_model_len=64, enable_sleep_mode=True)
    try:
        on.sleep(level=1)
        on.wake_up()
        assert on.generate(["hi"], use_tqdm=False)[0].outputs[0].token_ids
    finally:
        on.shutdown()
