"""data_parallel_backend="ray": each replica's ranks in a placement group of their own, in one
Ray cluster that the front end starts (and stops) or joins; outputs equal uni; a replica whose
actor dies fails the engine fast; nothing is left behind."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest
import ray
from ray.util.placement_group import placement_group_table

from shardserve import LLM, EngineDeadError

sys.path.insert(0, str(Path(__file__).parent))
from greedy_cases import greedy_tokens, uni_greedy_tokens  # noqa: E402
from ray_helpers import assert_no_ray_processes, our_segments, ray_env  # noqa: E402


def _where(worker) -> tuple[str, str]:
    return ray.get_runtime_context().get_placement_group_id() or "", str(os.getpid())


def test_ray_replicas_each_take_a_placement_group(tiny_llama_dir):
    want = uni_greedy_tokens(str(tiny_llama_dir))
    segments = our_segments()
    with ray_env():
        llm = LLM(str(tiny_llama_dir), dtype="float32", max_model_len=128, seed=0,
                  data_parallel_size=2, data_parallel_backend="ray", tensor_parallel_size=2,
                  ray_cpus_per_worker=0.5)
        try:
            assert ray.is_initialized()  # the front end started Ray for its replicas
            assert greedy_tokens(llm) == want
            where = llm.collective_rpc(_where)
            groups = {g for g, _ in where}
            assert len(where) == 4 and len(groups) == 2 and "" not in groups, where
            live = [g for g in placement_group_table().values() if g["state"] == "CREATED"]
            assert len(live) == 2 and all(len(g["bundles"]) == 2 for g in live), live
            # A replica's actor dies: the engine fails at once, naming the replica.
            victim = int(where[3][1])
            os.kill(victim, signal.SIGKILL)
            t0 = time.monotonic()
            with pytest.raises(EngineDeadError, match="engine core 1"):
                for _ in range(100):
                    greedy_tokens(llm)
            assert time.monotonic() - t0 < 10
        finally:
            llm.shutdown()
        assert not ray.is_initialized()  # started here, stopped here
        assert_no_ray_processes()
    assert our_segments() == segments


def test_ray_replicas_are_checked():
    with pytest.raises(ValueError, match="must be 'ray' or 'ray_v2'"):
        LLM(data_parallel_size=2, data_parallel_backend="ray",
            distributed_executor_backend="mp")
    with pytest.raises(ValueError, match="each replica creates its own"):
        LLM(data_parallel_size=2, data_parallel_backend="ray", ray_placement_group="pg")

