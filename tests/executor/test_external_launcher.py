"""external_launcher under a real torchrun: every rank runs the engine and returns what uni does."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import textwrap

import pytest

from shardserve import LLM, SamplingParams
from shardserve.engine.config_builder import engine_config_from_kwargs
from shardserve.executor.abstract import Executor
from shardserve.executor.external_launcher import ExternalLauncherExecutor
from tests.conftest import our_segments

PROMPTS = ["The quick brown fox", "def add(a, b):", "Hello, world! How are"]
PARAMS = [  # greedy, and seeded random sampling (which must not diverge across ranks)
    SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
    SamplingParams(max_tokens=12, temperature=0.8, seed=7),
    SamplingParams(max_tokens=12, temperature=1.0, top_k=20, seed=3),
]
SCRIPT = textwrap.dedent(
    """
    import json, os, pickle, sys
    from shardserve import LLM
    model, work, tp, pp, async_on = sys.argv[1:6]
    with open(work, "rb") as f:
        prompts, params = pickle.load(f)
    llm = LLM(model, dtype="float32", max_model_len=256, tensor_parallel_size=int(tp),
              pipeline_parallel_size=int(pp), async_scheduling=async_on == "1",
              distributed_executor_backend="external_launcher")
    outs = llm.generate(prompts, params, use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outs]
    with open(f"{work}.rank{os.environ['RANK']}.json", "w") as f:  # ranks share one stdout
        json.dump(tokens, f)
    llm.shutdown()
    """
)


# Sync scheduling with stages is not run under torchrun (the suite's time): it is the same
# scheduler and pipeline code as mp's test_pipeline.py::test_tp2_pp2_equals_uni[sync].
@pytest.mark.parametrize(
    ("tp", "pp", "async_on"),
    [(2, 1, True), (1, 2, True), (2, 2, True)],
    ids=["tp2", "pp2-async", "tp2xpp2"],
)
def test_torchrun_ranks_equal_uni(tiny_llama_dir, tmp_path, tp, pp, async_on) -> None:
    before = our_segments()
    llm = LLM(str(tiny_llama_dir), dtype="float32", max_model_len=256)
    try:
        want = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
    finally:
        llm.shutdown()
    script, work = tmp_path / "ranks.py", tmp_path / "work.pkl"
    script.write_text(SCRIPT)
    work.write_bytes(pickle.dumps((PROMPTS, PARAMS)))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone",
         "--nproc-per-node", str(tp * pp), str(script), str(tiny_llama_dir), str(work),
         str(tp), str(pp), "1" if async_on else "0"],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = [json.loads((tmp_path / f"work.pkl.rank{rank}.json").read_text())
           for rank in range(tp * pp)]  # fmt: skip
    assert all(g == want for g in got), (got, want)
    assert our_segments() == before


def test_without_a_launcher_the_error_says_how(tiny_llama_dir, monkeypatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    config = engine_config_from_kwargs(
        str(tiny_llama_dir), max_model_len=128, distributed_executor_backend="external_launcher"
    )
    assert Executor.get_class(config) is ExternalLauncherExecutor
    with pytest.raises(RuntimeError, match=r"RANK, WORLD_SIZE.*torchrun --nproc-per-node"):
        LLM(str(tiny_llama_dir), max_model_len=128,
            distributed_executor_backend="external_launcher")  # fmt: skip


def test_world_size_must_match_the_launcher(tiny_llama_dir, monkeypatch) -> None:
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": "1"}  # fmt: skip
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=r"WORLD_SIZE=3.*tensor_parallel_size x"):
        LLM(str(tiny_llama_dir), max_model_len=128, tensor_parallel_size=2,
            distributed_executor_backend="external_launcher")  # fmt: skip
