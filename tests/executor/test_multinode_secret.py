"""Multi-node mp on loopback, the cluster's secret and the refusals (multinode_helpers.py):
the options are checked; a headless node refuses to start without the secret and node 0 refuses
a node started for another layout; SIGTERM stops a headless node with two links; node 0 without
a secret makes one, prints it in the command that joins and writes no environment; a node joins
with the printed secret, and exits in time when node 0 dies."""

from __future__ import annotations

import os
import re
import signal
import textwrap
import time

import pytest
from multinode_helpers import (
    SECRET,
    Headless,
    free_port,
    gone_within,
    line_with,
    node_0_script,
)

from shardserve import LLM
from shardserve.engine.config_builder import engine_config_from_kwargs
from shardserve.executor.multinode.secret import (
    cluster_secret,
    headless_secret,
    link_keys,
    with_cluster_secret,
)
from tests.conftest import our_segments
from tests.sync_helpers import HANG_S


def test_multinode_options_are_checked(four_layer_model, cluster_env):
    with pytest.raises(ValueError, match="must divide"):
        LLM(str(four_layer_model), tensor_parallel_size=3, nnodes=2)
    with pytest.raises(ValueError, match="distributed_executor_backend='mp'"):
        LLM(str(four_layer_model), tensor_parallel_size=2, nnodes=2,
            distributed_executor_backend="ray")
    with pytest.raises(ValueError, match="--headless"):
        LLM(str(four_layer_model), tensor_parallel_size=2, nnodes=2, node_rank=1)
    with pytest.raises(ValueError, match="node_rank=2"):
        LLM(str(four_layer_model), tensor_parallel_size=2, nnodes=2, node_rank=2)


def test_headless_node_refuses_without_the_secret_or_a_matching_node_0(four_layer_model,
                                                                        cluster_env):
    env = {k: v for k, v in cluster_env.items() if k != "SHARDSERVE_CLUSTER_SECRET"}
    node1 = Headless(free_port(), str(four_layer_model), "--tensor-parallel-size", "2",
                     env=env)
    code, out = node1.finish()
    assert code == 2 and "SHARDSERVE_CLUSTER_SECRET" in out, out
    port = free_port()
    # Node 0 runs TP=2 over 2 nodes; this node was started for TP=4: node 0 refuses it.
    node1 = Headless(port, str(four_layer_model), "--tensor-parallel-size", "4",
                     "--worker-start-timeout-s", "30", env=cluster_env)
    # Node 0 waits 5 s only: the agent must be saying hello first (a loaded machine once took
    # longer than that to start it; it then waited for node 0 past finish()'s bound).
    node1.wait_for_line("waiting for node 0")
    with pytest.raises(Exception, match="did not connect"):
        LLM(str(four_layer_model), tensor_parallel_size=2, nnodes=2, master_port=port,
            worker_start_timeout_s=5)
    code, out = node1.finish()
    assert code == 1 and "refused this node" in out and "world size 4" in out, out


def test_headless_node_with_two_links_stops_on_sigterm(four_layer_model, cluster_env):
    """DP=3 x TP=2 over 2 nodes: node 1 holds rank 1 of replica 1 and both of replica 2, so it
    runs two links (threads); SIGTERM while they wait for node 0 ends both, and the process."""
    node1 = Headless(free_port(), str(four_layer_model), "--data-parallel-size", "3",
                     "--tensor-parallel-size", "2", env=cluster_env)
    node1.wait_for_line("waiting for node 0")  # then both links say hello to nobody
    time.sleep(0.5)
    node1.proc.send_signal(signal.SIGTERM)
    t0 = time.monotonic()
    code, out = node1.finish(timeout=30)
    assert code == 0 and "terminated" in out, out
    assert time.monotonic() - t0 < 10


def test_node_0_without_a_secret_makes_one_and_writes_no_environment(four_layer_model,
                                                                      monkeypatch, capsys):
    monkeypatch.delenv("SHARDSERVE_CLUSTER_SECRET", raising=False)
    config = engine_config_from_kwargs(str(four_layer_model), tensor_parallel_size=2, nnodes=2)
    carried = with_cluster_secret(config)
    secret = carried.parallel_config.multinode.cluster_secret
    err = capsys.readouterr().err
    assert secret and f"SHARDSERVE_CLUSTER_SECRET={secret} shardserve serve" in err, err
    assert "--headless --nnodes 2 --node-rank 1" in err, err
    assert "SHARDSERVE_CLUSTER_SECRET" not in os.environ
    assert secret not in repr(carried) and carried == config
    # Resolved once: the engine cores it reaches take the config's, printing nothing.
    assert with_cluster_secret(carried) is carried and cluster_secret(carried) == secret
    assert headless_secret(carried.parallel_config) == secret
    assert capsys.readouterr().err == ""
    with pytest.raises(ValueError, match="SHARDSERVE_CLUSTER_SECRET is not set"):
        headless_secret(config.parallel_config)
    monkeypatch.setenv("SHARDSERVE_CLUSTER_SECRET", SECRET)  # the user's wins, unprinted
    assert cluster_secret(config) == SECRET and capsys.readouterr().err == ""


NODE0 = textwrap.dedent("""
    import os, sys
    from shardserve import LLM, SamplingParams
    if __name__ == "__main__":
        llm = LLM(sys.argv[1], dtype="float32", max_model_len=128, tensor_parallel_size=2,
                  nnodes=2, master_port=int(sys.argv[2]))
        params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
        out = llm.generate(["hello world"], params, use_tqdm=False)
        print("DONE", len(out[0].outputs[0].token_ids),
              "SHARDSERVE_CLUSTER_SECRET" in os.environ, flush=True)
        params = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)
        while True:
            llm.generate(["hello world"] * 4, params, use_tqdm=False)
""")


def test_a_node_joins_with_the_printed_secret_and_exits_when_node_0_dies(
        four_layer_model, cluster_env, tmp_path):
    """Node 0 (a script of its own) without a secret makes one and prints the command that
    joins; node 1 joins with it, node 0 generates and has set no environment. Then node 0 is
    SIGKILLed while it generates: no goodbye (its own workers see their death pipes close),
    and the headless node exits with status 1 in time, naming node 0, leaving nothing behind.
    (One cluster for both, which were a test each; node 1's status 0 after node 0's clean
    shutdown is checked by every two_nodes() test.)"""
    segments_before = set(our_segments())
    env = {k: v for k, v in cluster_env.items() if k != "SHARDSERVE_CLUSTER_SECRET"}
    port = free_port()
    node0 = node_0_script(NODE0, tmp_path, four_layer_model, port, env)
    node1 = None
    try:
        line = line_with(node0, "SHARDSERVE_CLUSTER_SECRET=", HANG_S)
        found = re.search(r"SHARDSERVE_CLUSTER_SECRET=(\S+) shardserve serve", line)
        assert found, line
        node1 = Headless(port, str(four_layer_model), "--tensor-parallel-size", "2",
                         "--max-model-len", "128",
                         env={**env, "SHARDSERVE_CLUSTER_SECRET": found[1]})
        done = line_with(node0, "DONE", 120)
        assert done.split() == ["DONE", "8", "False"], done  # generated; no environment set
        time.sleep(0.5)
        node1.tree()
        node0.kill()  # SIGKILL: no goodbye; its own workers see their death pipes close
        killed_at = time.monotonic()
        code, out = node1.finish(timeout=30)
        waited = time.monotonic() - killed_at
        assert waited < 10.0, (waited, out)
        assert code == 1 and "node 0" in out, out
        assert gone_within(node1.alive, 5), node1.alive()
        print(f"\nthe headless node exited {waited:.1f} s after node 0 was killed")
    finally:
        for proc in (node0, *([node1.proc] if node1 else [])):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert gone_within(lambda: set(our_segments()) - segments_before, 10), our_segments()


def test_an_agent_refused_once_connects_to_the_next_listener(four_layer_model, cluster_env):
    """A restarted replica's predecessor can refuse a waiting agent in the moment between its
    domain's release and its port's close. libzmq never retries a refused handshake, and the
    agent once died there of zmq.Again (a hello with no connection to queue on): now it opens a
    fresh connection and says hello to the listener that follows on the same port."""
    import pickle

    import zmq
    from zmq.utils.monitor import recv_monitor_message

    from shardserve.executor.multinode.messages import NodeHello
    from shardserve.ipc.curve_auth import release, secure_server

    keys = link_keys(SECRET)
    port = free_port()
    refusing = zmq.Context.instance().socket(zmq.ROUTER)
    secure_server(refusing, keys, "test-refusing-predecessor")
    release("test-refusing-predecessor")  # its domain released, its port still open
    monitor = refusing.get_monitor_socket()
    refusing.bind(f"tcp://127.0.0.1:{port}")
    node1 = Headless(port, str(four_layer_model), "--tensor-parallel-size", "2", env=cluster_env)
    listener = None
    try:
        events = []
        while zmq.EVENT_HANDSHAKE_FAILED_AUTH not in events:
            assert monitor.poll(HANG_S * 1000), f"the agent was not refused: {events}"
            events.append(recv_monitor_message(monitor)["event"])
        refusing.disable_monitor()
        monitor.close(linger=0)
        refusing.close(linger=0)
        listener = zmq.Context.instance().socket(zmq.ROUTER)
        secure_server(listener, keys, "test-next-listener")
        for _ in range(100):  # the closed socket's port is released by zmq's I/O thread
            try:
                listener.bind(f"tcp://127.0.0.1:{port}")
                break
            except zmq.ZMQError:
                time.sleep(0.05)
        assert listener.poll(HANG_S * 1000), node1.finish(timeout=5)[1]
        assert isinstance(pickle.loads(listener.recv_multipart()[-1]), NodeHello)
    finally:
        node1.kill_tree()
        node1.finish()
        if listener is not None:
            listener.close(linger=0)
            release("test-next-listener")
