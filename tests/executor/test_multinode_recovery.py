"""Multi-node replica recovery on loopback (issue 27, "a server that heals", point 7): a lost
headless node is a dead replica like any other. Node 0 is `shardserve serve` (or this test
process's LLM), node 1 is `shardserve serve --headless` in a process tree of its own (as in
test_multinode.py, with multinode_helpers.py).

    (a) node 1's agent and workers SIGKILLed under a streamed request: the server restarts the
        replica, whose engine core waits for a new agent; the request completes with the text
        of an uninterrupted run; nothing is left behind;
    (b) a worker of node 0 killed: the replica restarts, and node 1's agent (the same process)
        serves the restarted replica, then exits 0 at the final shutdown;
    and the agent's ends: with restarts off, it exits with the replica as before; node 0 gone
    for good (restarts on) ends it after its bounded wait.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest

from shardserve import LLM, EngineDeadError, SamplingParams
from tests.conftest import our_segments
from tests.sync_helpers import HANG_S, wait_until

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1] / "entrypoints" / "server"))
from multinode_helpers import (  # noqa: E402
    Headless,
    _pid,  # node 1's workers unpickle it from there
    free_port,
    gone_within,
    line_with,
    node_0_script,
    two_nodes,
)
from server_helpers import Server, shm_segments  # noqa: E402
from test_server_recovery import BODY, Stream, complete  # noqa: E402

TP2 = ["--tensor-parallel-size", "2"]
# The bounds of a restart, short for the test: the front end's, and each agent's wait for
# node 0 (at the start, and again after a life of the replica ended).
RESTART = ["--engine-restart-timeout", "40"]
AGENT = [*TP2, "--max-model-len", "512", "--worker-start-timeout-s", "40"]


def _node0_pids(server: Server) -> set[int]:
    return {server.proc.pid, *(p.pid for p in server.observe())}


def test_lost_node_is_restarted_with_a_new_agent_and_the_stream_completes(
        tiny_llama_dir, cluster_env, tmp_path, no_leftovers):
    port = free_port()
    node1 = Headless(port, str(tiny_llama_dir), *AGENT, env=cluster_env)
    server = node1b = None
    try:
        server = Server(tiny_llama_dir, ["--dtype", "float32", "--max-model-len", "512",
                                         "--nnodes", "2", "--master-port", str(port), *TP2,
                                         *RESTART], tmp_path / "server.log", api_key=None,
                        env=cluster_env)
        body = {**BODY, "max_tokens": 120}
        reference = complete(server, body)
        core = server.engine_process()
        node1.tree()
        stream = Stream(server, body)
        wait_until(lambda: stream.events >= 2 or not stream.is_alive(), "the stream to begin")
        core.suspend()  # the request cannot finish before the node is lost
        try:
            assert stream.is_alive()
            node1.kill_tree()
            killed_at = time.monotonic()
        finally:
            core.resume()
        # The operator (or a supervisor) starts node 1's agent again, with the same command.
        node1b = Headless(port, str(tiny_llama_dir), *AGENT, env=cluster_env)
        stream.join(HANG_S)
        healed_in = time.monotonic() - killed_at
        assert stream.failure is None and not stream.errors, (stream.failure, stream.errors)
        assert stream.finish == "length" and stream.text == reference
        log = server.log()
        assert "engine core 0 died" in log and "node 1" in log, log
        assert httpx.get(f"{server.url}/health").json()["status"] == "ok"
        assert server.metric('shardserve:engine_restarts_total{engine="0"}') == 1
        assert complete(server, body) == reference  # the restarted replica serves on
        node1b.tree()
        family = _node0_pids(server)
        print(f"\nthe stream completed {healed_in:.1f} s after node 1 was killed")
        server.stop()
        code, out = node1b.finish()
        assert code == 0, out  # a final NodeStop: node 0 stopped for good
        assert not server.leftovers()
        assert gone_within(lambda: node1.alive() or node1b.alive(), 10)
        pids = family | node1.pids | node1b.pids
        assert gone_within(lambda: shm_segments(pids), 10), shm_segments(pids)
    finally:
        if server is not None and server.proc.poll() is None:
            server.stop()
        for agent in (node1, node1b):
            if agent is not None and agent.proc.poll() is None:
                agent.kill_tree()
                agent.finish()


def test_a_lost_node_that_does_not_come_back_fails_the_restart_in_its_bound(
        tiny_llama_dir, cluster_env, tmp_path, no_leftovers):
    """No new agent: the restarted engine core waits for node 1 within the restart's bound
    (--engine-restart-timeout 8: 4 s for the node), fails naming the command that starts it,
    and with the restart bound reached the server fails as without recovery."""
    port = free_port()
    node1 = Headless(port, str(tiny_llama_dir), *AGENT, env=cluster_env)
    server = None
    try:
        server = Server(tiny_llama_dir, ["--dtype", "float32", "--max-model-len", "512",
                                         "--nnodes", "2", "--master-port", str(port), *TP2,
                                         "--engine-restart-timeout", "8",
                                         "--max-engine-restarts", "1"],
                        tmp_path / "server.log", api_key=None, env=cluster_env)
        stream = Stream(server, {**BODY, "max_tokens": 120})
        wait_until(lambda: stream.events >= 2 or not stream.is_alive(), "the stream to begin")
        core = server.engine_process()
        core.suspend()
        try:
            node1.kill_tree()
            family = _node0_pids(server)
        finally:
            core.resume()
        killed_at = time.monotonic()
        stream.join(HANG_S)
        assert stream.errors or stream.failure, stream.text
        server.proc.wait(HANG_S)
        failed_in = time.monotonic() - killed_at
        family |= server.family
        log = server.log()
        assert server.proc.returncode == 1, log
        assert "nodes [1] did not connect" in log and "within 4 s" in log, log
        assert "--headless --nnodes 2 --node-rank R" in log, log
        print(f"\nthe server gave up {failed_in:.1f} s after node 1 was killed")
        server.stop()
        assert not server.leftovers()
        assert gone_within(lambda: shm_segments(family | node1.pids), 10)
    finally:
        if server is not None and server.proc.poll() is None:
            server.stop()
        if node1.proc.poll() is None:
            node1.kill_tree()
        node1.finish()


def test_the_agent_serves_the_replica_restarted_after_a_worker_death_on_node_0(
        tiny_llama_dir, cluster_env, no_leftovers):
    # The restart's bound only catches a hang: node 0 waits for node 1's agent 10 s less than
    # it (multiproc._node_wait_s), and in the suite (three files at a time on two cores) the
    # agent once took over 30 s to tear down its worker and say hello again.
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    with two_nodes(tiny_llama_dir, cluster_env, AGENT, max_model_len=512,
                   tensor_parallel_size=2, max_engine_restarts=1,
                   engine_restart_timeout_s=90) as (llm, node1):
        prompts = ["hello world", "The quick brown fox"]
        want = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        before = llm.collective_rpc(_pid)
        assert before[1] in node1.tree() and before[0] not in node1.tree()
        os.kill(before[0], signal.SIGKILL)  # node 0's rank: the replica dies, node 1 lives
        t0 = time.monotonic()
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        print(f"\nrestarted and generated in {time.monotonic() - t0:.1f} s")
        assert got == want
        assert llm.engine.restart.restarts == 1
        after = llm.collective_rpc(_pid)
        # The same agent started rank 1 again: a new worker under it.
        assert node1.proc.poll() is None and after[1] in node1.tree() and after[1] != before[1]
        node1.wait_for_line("waiting for node 0 to start replica 0 again", timeout=10)
    # (two_nodes: the final shutdown ends the agent with status 0)


def test_without_restarts_the_agent_exits_with_the_replica(tiny_llama_dir, cluster_env,
                                                           no_leftovers):
    """LLM's default (no restarts): a worker death on node 0 ends node 1's agent as before."""
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    port = free_port()
    node1 = Headless(port, str(tiny_llama_dir), *AGENT, env=cluster_env)
    try:
        llm = LLM(str(tiny_llama_dir), dtype="float32", max_model_len=512,
                  tensor_parallel_size=2, nnodes=2, master_port=port,
                  max_engine_restarts=0)
        try:
            os.kill(llm.collective_rpc(_pid)[0], signal.SIGKILL)
            with pytest.raises(EngineDeadError):
                for _ in range(50):
                    llm.generate(["hello"], params, use_tqdm=False)
                    time.sleep(0.1)
        finally:
            llm.shutdown()
        code, out = node1.finish(timeout=30)
        assert code == 0 and "again" not in out, out
    finally:
        if node1.proc.poll() is None:
            node1.kill_tree()
            node1.finish()


NODE0_RESTARTS = textwrap.dedent("""
    import sys
    from shardserve import LLM, SamplingParams
    if __name__ == "__main__":
        llm = LLM(sys.argv[1], dtype="float32", max_model_len=128, tensor_parallel_size=2,
                  nnodes=2, master_port=int(sys.argv[2]), max_engine_restarts=1)
        print("STARTED", flush=True)
        params = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)
        while True:
            llm.generate(["hello world"] * 4, params, use_tqdm=False)
""")


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()  # says nothing
        return True
    except OSError:
        return False


def test_node_0_gone_for_good_ends_the_agent_after_its_bounded_wait(tiny_llama_dir, cluster_env,
                                                                    tmp_path):
    """Node 0 restarts replicas, and is SIGKILLed: the agent cannot tell that from a replica
    that died, so it waits for a restart, at most its --worker-start-timeout-s, then exits 1
    (leaving nothing behind)."""
    segments_before = set(our_segments())
    port = free_port()
    node0 = node_0_script(NODE0_RESTARTS, tmp_path, tiny_llama_dir, port, cluster_env)
    node1 = None
    try:
        wait_until(lambda: _listening(port) or node0.poll() is not None, "node 0 to listen")
        node1 = Headless(port, str(tiny_llama_dir), *TP2, "--max-model-len", "128",
                         "--worker-start-timeout-s", "4", env=cluster_env)
        assert "STARTED" in line_with(node0, "STARTED", HANG_S)
        time.sleep(0.5)
        node1.tree()
        os.killpg(node0.pid, signal.SIGKILL)  # node 0 and its workers: no goodbye
        killed_at = time.monotonic()
        code, out = node1.finish(timeout=30)
        waited = time.monotonic() - killed_at
        assert code == 1 and "waiting for node 0 to start replica 0 again" in out, out
        assert "did not start the replica again within 4 s" in out, out
        assert 4.0 < waited < 15.0, (waited, out)
        assert gone_within(node1.alive, 5), node1.alive()
        print(f"\nthe agent exited {waited:.1f} s after node 0 was killed")
    finally:
        for proc in (node0, *([node1.proc] if node1 else [])):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert gone_within(lambda: set(our_segments()) - segments_before, 10), our_segments()
