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
from shardserve.lora.request import LoRARequest
from tests.conftest import TP3, our_segments
from tests.executor.lora_cases import tiny_adapter, uni_lora_tokens

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
    extra = json.loads(sys.argv[6]) if len(sys.argv) > 6 else {}  # more LLM options
    with open(work, "rb") as f:
        prompts, params, lora = pickle.load(f)
    llm = LLM(model, dtype="float32", max_model_len=256, tensor_parallel_size=int(tp),
              pipeline_parallel_size=int(pp), async_scheduling=async_on == "1",
              distributed_executor_backend="external_launcher",
              enable_lora=lora is not None, max_lora_rank=8, **extra)
    outs = llm.generate(prompts, params, use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outs]
    accepted = llm.get_metrics()["spec_decode_num_accepted_tokens"]
    adapter = None  # with an adapter: its outputs, and the lists of every rank (gathered)
    if lora is not None:
        outs = llm.generate(prompts, params, use_tqdm=False, lora_request=lora)
        adapter = [[o.outputs[0].token_ids for o in outs], llm.engine.core.executor.list_loras()]
        llm.remove_lora(lora.lora_int_id)
        adapter.append(llm.engine.core.executor.list_loras())
    with open(f"{work}.rank{os.environ['RANK']}.json", "w") as f:  # ranks share one stdout
        json.dump([tokens, accepted, adapter], f)
    llm.shutdown()
    """
)


def test_torchrun_tp2_pp2_ranks_equal_uni(tiny_llama_dir, tmp_path) -> None:
    """TP=2 x PP=2 (four ranks, async scheduling): each rank builds its TP group inside its
    stage and its PP group across them from the launcher's RANK, and a LoRA adapter is loaded
    by every rank's engine on its own worker (TP shards, each stage its layer); the ranks'
    lists are gathered and agree, and the outputs with and without it equal uni's.

    TP=2 alone and PP=2 alone under torchrun were cases of their own: both groups form here
    (the group lists themselves: tests/distributed/test_rank_layout.py), PP=2 without TP with
    sync scheduling is test_torchrun_speculative_decoding_equals_uni, and sync scheduling with
    stages is the same scheduler and pipeline code as mp's test_pipeline.py::
    test_tp2_pp2_equals_uni[sync]."""
    before = our_segments()
    want = _uni(tiny_llama_dir, PROMPTS)
    lora = tiny_adapter(tiny_llama_dir, tmp_path / "adapter")
    got = _torchrun(tiny_llama_dir, tmp_path, PROMPTS, 2, 2, True, lora=lora)
    assert all(tokens == want for tokens, _, _ in got), (got, want)
    want_lora = uni_lora_tokens(tiny_llama_dir, lora, PROMPTS, PARAMS)
    assert all(adapter == [want_lora, [1], []] for _, _, adapter in got), got
    assert our_segments() == before


def test_torchrun_speculative_decoding_equals_uni(echo_model, tmp_path) -> None:
    """Every rank runs its own scheduler, so every last-stage rank proposes the same drafts
    and verifies them in step with the others: the outputs of uni without speculation."""
    prompts = [{"prompt_token_ids": [66] * 8}, {"prompt_token_ids": [7, 8, 9, 7, 8, 9, 7]},
               "Hello"]
    want = _uni(echo_model, prompts)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
            "prompt_lookup_max": 3, "min_acceptance_rate": 0.0, "max_batch_for_speculation": 64}
    got = _torchrun(echo_model, tmp_path, prompts, 1, 2, False, {"speculative_config": spec})
    assert all(tokens == want for tokens, _, _ in got), (got, want)
    assert all(accepted > 0 for _, accepted, _ in got), got  # drafts were really verified


def _uni(model, prompts: list) -> list[list[int]]:
    llm = LLM(str(model), dtype="float32", max_model_len=256)
    try:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS, use_tqdm=False)]
    finally:
        llm.shutdown()


def _torchrun(model, tmp_path, prompts: list, tp: int, pp: int, async_on: bool,
              extra: dict | None = None, lora: LoRARequest | None = None,
              nproc: int | None = None) -> list[list]:
    """Each rank's [tokens, drafts accepted, adapter results or None] from SCRIPT under
    torchrun (`extra`: more LLM options; `nproc`: the ranks, tp x pp unless given)."""
    script, work = tmp_path / "ranks.py", tmp_path / "work.pkl"
    script.write_text(SCRIPT)
    work.write_bytes(pickle.dumps((prompts, PARAMS, lora)))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    nproc = nproc or tp * pp
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone",
         "--nproc-per-node", str(nproc), str(script), str(model), str(work),
         str(tp), str(pp), "1" if async_on else "0"] + ([json.dumps(extra)] if extra else []),
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads((tmp_path / f"work.pkl.rank{rank}.json").read_text())
            for rank in range(nproc)]  # fmt: skip


def test_torchrun_prefill_context_parallel_equals_uni(tiny_llama_dir, tmp_path) -> None:
    """PCP=2 with async scheduling (each prompt's prefill split over the two ranks): every
    rank's engine returns uni's greedy and seeded random tokens. (The default model against HF
    with PCP=2: mp's test_context_parallel_mp.py and Ray's test_ray.py; under torchrun two
    default-model ranks checked what the launcher does the same at any model size.)"""
    prompts = [" ".join([p] * 10) for p in PROMPTS]  # long enough that both ranks get a part
    want = _uni(tiny_llama_dir, prompts)
    got = _torchrun(tiny_llama_dir, tmp_path, prompts, 1, 1, True,
                    {"prefill_context_parallel_size": 2}, nproc=2)
    assert all(tokens == want for tokens, _, _ in got), (got, want)


def test_torchrun_decode_context_parallel_equals_uni(tmp_path, tiny_model_builder) -> None:
    """TP=3 x DCP=3 with sync scheduling (the KV cache sharded by position over the three TP
    ranks, one KV head each) on the tiny TP3-shape model: every rank returns uni's greedy and
    seeded random tokens. (The default model against HF at TP=3 x DCP=3: mp's
    test_context_parallel_mp.py and Ray's test_ray.py; under torchrun it took three default-
    model ranks for what the launcher does the same at any model size.)"""
    model = tiny_model_builder("LlamaForCausalLM", tmp_path / "tp3", **TP3)
    want = _uni(model, PROMPTS)
    got = _torchrun(model, tmp_path, PROMPTS, 3, 1, False, {"decode_context_parallel_size": 3})
    assert all(tokens == want for tokens, _, _ in got), (got, want)


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
