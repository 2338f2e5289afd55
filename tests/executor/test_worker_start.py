"""How mp workers start: spawn failures explain themselves, and a worker that raises during
start-up hands its exception and traceback to the parent. (That the plain script runs, its
workers forked, is test_core_start_method.py's TP=3 case: the same script, its tokens equal to
the guarded script's.)"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from shardserve import LLM

pytestmark = pytest.mark.usefixtures("no_leftovers")

# A user's script as written without a main guard; it also runs a parallel torch kernel first,
# so the parent's OpenMP pool exists when the workers are forked.
UNGUARDED = textwrap.dedent(
    """
    import sys
    import torch
    a = torch.randn(512, 512)
    a @ a
    from shardserve import LLM, SamplingParams
    llm = LLM(sys.argv[1], tensor_parallel_size=3, distributed_executor_backend="mp",
              dtype="float32", max_model_len=128)
    out = llm.generate(["Hello, world!"], SamplingParams(max_tokens=6, temperature=0))
    print("TOKENS", out[0].outputs[0].token_ids)
    """
)

TP3 = dict(hidden_size=96, intermediate_size=192, num_attention_heads=6, num_key_value_heads=3)


@pytest.fixture(scope="module")
def tp3_model(tmp_path_factory, tiny_model_builder):
    return tiny_model_builder("LlamaForCausalLM", tmp_path_factory.mktemp("tp3_start"), **TP3)


def _run_script(tmp_path, model, method: str | None) -> subprocess.CompletedProcess:
    script = tmp_path / "user_script.py"
    script.write_text(UNGUARDED)
    env = {k: v for k, v in os.environ.items() if k != "SHARDSERVE_WORKER_MULTIPROC_METHOD"}
    if method is not None:
        env["SHARDSERVE_WORKER_MULTIPROC_METHOD"] = method
    return subprocess.run(
        [sys.executable, str(script), str(model)],
        capture_output=True, text=True, timeout=240, cwd=tmp_path, env=env,
    )  # fmt: skip


def test_unguarded_script_under_spawn_says_what_to_fix(tmp_path, tp3_model):
    proc = _run_script(tmp_path, tp3_model, "spawn")
    assert proc.returncode != 0
    assert "user_script.py:7 starts an engine at the top level" in proc.stderr, proc.stderr
    assert 'if __name__ == "__main__":' in proc.stderr
    assert "died during start-up" not in proc.stderr  # refused before any worker started


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_worker_raising_at_start_up_reports_its_traceback(
    tiny_llama_dir, monkeypatch, method
):
    monkeypatch.setenv("SHARDSERVE_WORKER_MULTIPROC_METHOD", method)
    with pytest.raises(RuntimeError) as err:
        LLM(str(tiny_llama_dir), dtype="float32", max_model_len=128, tensor_parallel_size=2,
            worker_cls="faulty_worker.BrokenWeightsWorker")  # fmt: skip
    message = str(err.value)
    assert type(err.value).__name__ == "WorkerStartupError"
    for part in ("worker rank 1", "FileNotFoundError", "rank1-weights.safetensors",
                 "--- worker traceback ---", "Traceback (most recent call last)",
                 "in load_model"):  # fmt: skip
        assert part in message, message


def test_bad_start_method_is_refused(tiny_llama_dir, monkeypatch):
    monkeypatch.setenv("SHARDSERVE_WORKER_MULTIPROC_METHOD", "forkserver-ish")
    with pytest.raises(ValueError, match="SHARDSERVE_WORKER_MULTIPROC_METHOD='forkserver-ish'"):
        LLM(str(tiny_llama_dir), dtype="float32", max_model_len=128, tensor_parallel_size=2)
