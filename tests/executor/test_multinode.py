"""Multi-node mp on loopback: node 0 is this test process (LLM with nnodes=2), node 1 is
`shardserve serve --headless` in a process tree of its own (multinode_helpers.py). Outputs equal
uni's (TP=2, TP=2 x PP=2, PCP=2, DP=2 x TP=2); the cross-node hops really take the TCP / gloo
paths (the default model's PP=2 against HF is mp's on one node, test_pipeline.py: across nodes
only the hand-off's transport differs, gloo here, asserted on TP=2 x PP=2); killing the
headless node is noticed in time and leaves nothing behind; strangers on the ports get nothing;
a second node with a taken rank is refused. (The secret, refusals at the handshake and node 0's
death: test_multinode_secret.py.)"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest
import zmq
from multinode_helpers import (
    Headless,
    _pid,
    cluster_environment,
    free_port,
    gone_within,
    two_nodes,
)

from shardserve import LLM, EngineDeadError, SamplingParams
from tests.conftest import our_children, our_segments

sys.path.insert(0, str(Path(__file__).parents[1] / "engine"))
sys.path.insert(0, str(Path(__file__).parents[1] / "entrypoints"))
sys.path.insert(0, str(Path(__file__).parents[1] / "ipc"))
from async_cases import run_cases  # noqa: E402
from curve_strangers import assert_received_nothing, strangers  # noqa: E402
from greedy_cases import greedy_tokens, uni_greedy_tokens  # noqa: E402
from lora_cases import LORA_OPTIONS, check_adapter_calls, tiny_adapter, uni_lora_tokens  # noqa: E402


def _paths(worker) -> dict[str, int]:
    from shardserve.distributed.parallel_state import get_pp_group, get_tp_group

    tp, pp = get_tp_group(), get_pp_group()
    return {"tp_shm": tp.shm_calls, "tp_gloo": tp.fallback_calls, "pp_shm": pp.shm_calls,
            "pp_gloo": pp.fallback_calls}


@pytest.fixture(scope="module")
def lora_case(four_layer_model, tmp_path_factory):
    """An adapter of the 4-layer model and uni's outputs through it."""
    lora = tiny_adapter(four_layer_model, tmp_path_factory.mktemp("multinode_lora"))
    return lora, uni_lora_tokens(four_layer_model, lora, LORA_PROMPTS, LORA_GREEDY, 128)


LORA_PROMPTS = ["The quick brown fox", "def add(a, b):"]
LORA_GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def tp2_cluster(four_layer_model, lora_case):
    """TP=2 over two nodes on the 4-layer model (LoRA on), shared by the tests that neither
    kill nor stop a node: a cluster's start is three fresh interpreters (~10 s of CPU). Two
    node-1 agents with the same rank are started (test_a_second_node_with_the_same_rank_is_
    refused): node 0 takes one and refuses the other. At the end node 1 stops by node 0's
    request (status 0), and nothing of the cluster is left (processes, segments)."""
    segments_before = set(our_segments())
    children_before = {p.pid for p in our_children()}
    ports_before = _listening_ports({os.getpid()})
    flags = ["--tensor-parallel-size", "2", "--max-model-len", "128"]
    with pytest.MonkeyPatch.context() as patch:
        env = cluster_environment(patch)
        port = free_port()
        twins = [Headless(port, str(four_layer_model), *flags, env=env) for _ in range(2)]
        try:
            llm = LLM(str(four_layer_model), dtype="float32", max_model_len=128, seed=0,
                      tensor_parallel_size=2, nnodes=2, master_port=port, **LORA_OPTIONS)
            try:
                gone_within(lambda: all(t.proc.poll() is None for t in twins), 30)
                refused = [t for t in twins if t.proc.poll() is not None]
                node1 = next(t for t in twins if t not in refused)
                yield SimpleNamespace(llm=llm, node1=node1, children_before=children_before,
                                      ports_before=ports_before,
                                      refused=[t.finish() for t in refused])
            finally:
                llm.shutdown()
            code, out = node1.finish()
            assert code == 0, out
        finally:
            for t in twins:
                if t.proc.poll() is None:
                    t.kill_tree()
                    t.finish()
    assert gone_within(lambda: {p.pid for p in our_children()} - children_before, 30)
    assert gone_within(lambda: set(our_segments()) - segments_before, 10), our_segments()


LORA_PROMPTS = ["The quick brown fox", "def add(a, b):"]
LORA_GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def _equals_uni_with_adapter(llm: LLM, pp_uni_results, lora_case) -> dict[str, int]:
    """Every async workload as uni, and a LoRA adapter on the ranks of both nodes (TP shards,
    each stage its layers): returns the collectives' paths of rank 0."""
    tokens, stop_text, want = pp_uni_results
    assert run_cases(llm, tokens, stop_text) == want
    check_adapter_calls(llm, lora_case[0], LORA_PROMPTS, LORA_GREEDY, lora_case[1])
    return llm.collective_rpc(_paths)[0]


def test_tiny_model_tp2_across_two_nodes_equals_uni(tp2_cluster, pp_uni_results, lora_case,
                                                    no_leftovers):
    paths = _equals_uni_with_adapter(tp2_cluster.llm, pp_uni_results, lora_case)
    # One TP group over both nodes: gloo.
    assert paths["tp_shm"] == 0 and paths["tp_gloo"] > 0, paths


def test_tiny_model_tp2xpp2_across_two_nodes_equals_uni(four_layer_model, pp_uni_results,
                                                        cluster_env, lora_case, no_leftovers):
    flags = ["--tensor-parallel-size", "2", "--pipeline-parallel-size", "2",
             "--max-model-len", "128"]
    with two_nodes(four_layer_model, cluster_env, flags, max_model_len=128, seed=0,
                   tensor_parallel_size=2, pipeline_parallel_size=2,
                   **LORA_OPTIONS) as (llm, _):
        paths = _equals_uni_with_adapter(llm, pp_uni_results, lora_case)
    # Each stage's TP pair on one node: shared memory; the stages: gloo.
    assert paths["tp_shm"] > 0 and paths["pp_gloo"] > 0, paths
    assert paths["pp_shm"] == 0, paths


def _pcp_paths(worker) -> tuple[int, int]:
    from shardserve.distributed.parallel_state import get_pcp_group

    return get_pcp_group().shm_calls, get_pcp_group().fallback_calls


def test_pcp_group_across_two_nodes_equals_uni(four_layer_model, pp_uni_results, cluster_env,
                                               no_leftovers):
    """PCP=2 with one context shard on each node: the prompt's halves meet over gloo."""
    tokens, stop_text, want = pp_uni_results
    flags = ["--prefill-context-parallel-size", "2", "--max-model-len", "128"]
    with two_nodes(four_layer_model, cluster_env, flags, max_model_len=128, seed=0,
                   prefill_context_parallel_size=2) as (llm, _):
        assert run_cases(llm, tokens, stop_text) == want
        shm, gloo = llm.collective_rpc(_pcp_paths)[0]
        assert shm == 0 and gloo > 0, (shm, gloo)


def _init_method(worker) -> str:
    return worker.distributed_init_method


def test_data_parallel_replicas_across_two_nodes_equal_uni(four_layer_model, cluster_env,
                                                            no_leftovers):
    """DP=2 x TP=2 over 2 nodes: replica 0's ranks on node 0, replica 1's on node 1 (its
    engine core stays on node 0 and drives them over TCP)."""
    want = uni_greedy_tokens(str(four_layer_model))
    flags = ["--data-parallel-size", "2", "--tensor-parallel-size", "2", "--max-model-len", "128"]
    with two_nodes(four_layer_model, cluster_env, flags, max_model_len=128, seed=0,
                   data_parallel_size=2, tensor_parallel_size=2) as (llm, node1):
        assert greedy_tokens(llm) == want
        # Replica 1's rank 0 runs on node 1: torch's rendezvous store is served by its engine
        # core on node 0 (with tcp://, rank 0 would serve it on node 1 while the others dial
        # node 0: loopback would not tell).
        inits = llm.collective_rpc(_init_method)
        assert inits[0].startswith("file://") and inits[2].startswith("tcpstore://"), inits
        pids = llm.collective_rpc(_pid)
        on_node1 = [pid in node1.tree() for pid in pids]
        assert on_node1 == [False, False, True, True], (pids, node1.pids)
        with pytest.raises(ValueError, match="spans nodes"):
            llm.scale(1)


def test_killing_the_headless_node_fails_node_0_fast(four_layer_model, cluster_env,
                                                      no_leftovers):
    port = free_port()
    node1 = Headless(port, str(four_layer_model), "--tensor-parallel-size", "2",
                     "--max-model-len", "128", env=cluster_env)
    llm = LLM(str(four_layer_model), dtype="float32", max_model_len=128,
              tensor_parallel_size=2, nnodes=2, master_port=port)
    errors: list[BaseException] = []
    raised_at: list[float] = []

    def keep_generating() -> None:
        params = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)
        try:
            for _ in range(10_000):
                llm.generate(["hello world"] * 8, params, use_tqdm=False)
        except BaseException as e:
            raised_at.append(time.monotonic())
            errors.append(e)

    thread = threading.Thread(target=keep_generating)
    try:
        thread.start()
        time.sleep(1.0)
        assert not errors, errors
        node1.kill_tree()
        killed_at = time.monotonic()
        thread.join(timeout=30)
        assert errors and isinstance(errors[0], EngineDeadError), errors
        assert "node 1" in str(errors[0]) and "ranks [1]" in str(errors[0]), errors[0]
        assert raised_at[0] - killed_at < 5.0, raised_at[0] - killed_at
        print(f"\nnode 0 raised {raised_at[0] - killed_at:.2f} s after the kill: {errors[0]}")
    finally:
        llm.shutdown()
        thread.join(timeout=30)
        if node1.proc.poll() is None:
            node1.kill_tree()
        node1.proc.communicate()
    assert gone_within(node1.alive, 10), node1.alive()


def _listening_ports(pids: set[int]) -> set[int]:
    ports = set()
    for pid in pids:
        try:
            conns = psutil.Process(pid).net_connections(kind="tcp")
        except psutil.Error:
            continue
        ports |= {c.laddr.port for c in conns if c.status == psutil.CONN_LISTEN}
    return ports


def _cluster_pids(node1: Headless, before: set[int]) -> set[int]:
    ours = {os.getpid()} | {p.pid for p in psutil.Process().children(recursive=True)}
    return (ours - before) | {os.getpid()} | node1.tree()


def _cluster_pids(node1: Headless, before: set[int]) -> set[int]:
    ours = {os.getpid()} | {p.pid for p in psutil.Process().children(recursive=True)}
    return (ours - before) | {os.getpid()} | node1.tree()


def test_strangers_on_every_port_of_the_cluster_get_nothing(tp2_cluster, no_leftovers):
    """The handshake port, the broadcast's TCP port and node 1's reply-queue port get keyed
    and keyless ZMQ strangers and raw junk; every other port either side listens on (torch's
    own: gloo's listeners) gets a raw connection that says nothing. None of them receives
    anything, and the engine's steps take as long with them connected. (torch's rendezvous
    store is closed once every rank is ready.)"""
    llm, node1 = tp2_cluster.llm, tp2_cluster.node1
    strangers_: list = []
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    llm.generate(["warm up"] * 8, params, use_tqdm=False)

    def timed() -> float:
        t0 = time.perf_counter()
        for _ in range(2):
            llm.generate(["hello world"] * 8, params, use_tqdm=False)
        return time.perf_counter() - t0

    try:
        alone = timed()
        rpc = llm.engine.core.executor.rpc
        master_port = llm.config.parallel_config.multinode.master_port
        strangers_ += strangers(f"tcp://127.0.0.1:{master_port}", zmq.DEALER)
        ours = [master_port, *(int(h.remote_addr.rsplit(":", 1)[1])
                               for h in (rpc.broadcast.export_handle(), rpc.reply_handles[1]))]
        strangers_ += strangers(rpc.broadcast.export_handle().remote_addr)
        strangers_ += strangers(rpc.reply_handles[1].remote_addr)
        others = (_listening_ports(_cluster_pids(node1, tp2_cluster.children_before))
                  - tp2_cluster.ports_before - set(ours))
        for port in sorted(others):
            strangers_.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        store = llm.engine.core.executor.store_port
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", store), timeout=5).close()
        time.sleep(0.5)
        watched = timed()
        assert_received_nothing(strangers_)
        print(f"\n2 x 8 x 32 tokens: {alone:.2f} s alone, {watched:.2f} s with "
              f"{len(strangers_)} strangers (torch's ports: {sorted(others)})")
        assert watched < 3 * alone + 2.0  # a hang-catcher: 2 cores, both "nodes" on them
    finally:
        for sock in strangers_:
            sock.close()
    time.sleep(1.0)  # their connections closing is no node's: nothing is declared lost
    llm.generate(["still healthy"], params, use_tqdm=False)


def test_a_second_node_with_the_same_rank_is_refused(tp2_cluster, no_leftovers):
    """Two agents for node_rank 1 (tp2_cluster starts them): node 0 takes the first to say
    hello, the other exits 1 naming the taken rank, and the first serves on (it stops with
    status 0 at the cluster's end)."""
    assert len(tp2_cluster.refused) == 1, tp2_cluster.refused
    code, out = tp2_cluster.refused[0]
    assert code == 1 and "node_rank 1 is taken already" in out, out
    assert greedy_tokens(tp2_cluster.llm)
