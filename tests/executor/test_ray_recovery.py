"""Replica recovery on ray_v2 through the real server (issue 27's chaos test, its Ray variant; the
mp and DP variants are tests/entrypoints/server/test_server_chaos.py, whose run_chaos this file
uses): while 32 streaming openai clients keep sending the oracle prompts, a random worker actor
(ray::RayWorkerWrapper) of the server's ray_v2 replica is SIGKILLed every KILL_EVERY_S seconds;
the engine core sees the actor's death, the replica is restarted (a new local Ray with it) and
its requests continue: every stream equals its uninterrupted reference, no client sees an error,
the server never exits, and once it stopped nothing of it is left (processes, Ray's included,
shardserve's /dev/shm segments, the semaphores of its raylets).

Its own file, and so its own interpreter (Makefile: RAY_TESTS); Ray runs in the server's engine
core, not here, but the environment (ray_env: a short RAY_TMPDIR, no usage report) is the other
Ray files'. SHARDSERVE_TEST_CHAOS_S=60 runs the acceptance's 60 s (and adds the default model).
"""

from __future__ import annotations

import glob
import sys
from pathlib import Path

import pytest

pytest.importorskip("ray")

sys.path.insert(0, str(Path(__file__).parents[1] / "entrypoints" / "server"))
from ray_helpers import ray_env  # noqa: E402
from server_helpers import Server  # noqa: E402
from test_server_chaos import (  # noqa: E402
    ACCEPTANCE_RUN,
    ARGS,
    TIMEOUT_S,
    pool,
    run_chaos,
    tiny_prompts,
)

# The tiny Llama at TP=2 (two actors); the acceptance run adds the default model at TP=1 (its
# 9 heads and 3 KV heads allow no TP=2, and TP=3 would want 3 CPUs' worth of actors here).
CASES = [pytest.param("tiny", 2, id="tiny-tp2")] + (
    [pytest.param("default", 1, id="default-tp1")] if ACCEPTANCE_RUN else [])


@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize(("model", "tp"), CASES)
def test_ray_v2_chaos_worker_actor_killed(request, tiny_llama_dir, tmp_path, model, tp):
    args = [*ARGS, "--distributed-executor-backend", "ray_v2", "--tensor-parallel-size",
            str(tp), "--worker-start-timeout-s", "120"]
    with ray_env():  # the server and its engine cores inherit it
        if model == "tiny":
            prompts = tiny_prompts(tiny_llama_dir)
            server = Server(tiny_llama_dir, args, tmp_path / "server.log")
        else:
            request.getfixturevalue("default_model_path")
            from pp_oracle import oracle_prompt_ids

            from shardserve.model.loader import default_model_path, load_tokenizer

            prompts = oracle_prompt_ids(load_tokenizer(default_model_path()))
            server = Server(None, args, tmp_path / "server.log")
        try:
            run_chaos(server, prompts, pool("mixed"), "worker")
        finally:
            server.stop()
    assert not server.leftovers()
    semaphores = [p for pid in server.family
                  for p in glob.glob(f"/dev/shm/sem.obj{pid}-*") + glob.glob(
                      f"/dev/shm/sem.hdr{pid}-*")]
    assert not semaphores, semaphores
