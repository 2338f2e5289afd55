"""Multi-node mp on loopback: node 0 is this test process (LLM with nnodes=2), node 1 is
`shardserve serve --headless` in a process tree of its own. Outputs equal HF (PP=2) and uni
(TP=2, TP=2 x PP=2); the cross-node hops really take the TCP / gloo paths; killing either side
is noticed in time and leaves nothing behind; strangers on the ports get nothing; node 0
without a secret makes one, prints it in the command that joins, and writes no environment."""

from __future__ import annotations

import contextlib
import os
import re
import select
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import zmq

from shardserve import LLM, EngineDeadError, SamplingParams
from shardserve.engine.config_builder import engine_config_from_kwargs
from shardserve.executor.multinode.secret import (
    cluster_secret,
    headless_secret,
    with_cluster_secret,
)
from tests.conftest import our_segments
from tests.sync_helpers import HANG_S

sys.path.insert(0, str(Path(__file__).parents[1] / "engine"))
sys.path.insert(0, str(Path(__file__).parents[1] / "entrypoints"))
sys.path.insert(0, str(Path(__file__).parents[1] / "ipc"))
from async_cases import run_cases  # noqa: E402
from curve_strangers import assert_received_nothing, strangers  # noqa: E402
from greedy_cases import greedy_tokens, uni_greedy_tokens  # noqa: E402
from lora_cases import LORA_OPTIONS, check_adapter_calls, tiny_adapter, uni_lora_tokens  # noqa: E402
from pp_oracle import assert_matches_hf  # noqa: E402

SECRET = "multinode-test-secret"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture()
def cluster_env(monkeypatch) -> dict[str, str]:
    monkeypatch.setenv("SHARDSERVE_CLUSTER_SECRET", SECRET)
    monkeypatch.setenv("SHARDSERVE_NUM_THREADS", "1")  # two "machines" share 2 cores
    # Node 1's workers unpickle this module's functions (collective_rpc) by reference.
    here = str(Path(__file__).parent)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [here, os.environ.get(
        "PYTHONPATH")])))
    return {**os.environ}


class Headless:
    """`shardserve serve --headless` as node 1, in a session of its own (killable as a tree)."""

    def __init__(self, port: int, model: str | None, *flags: str, env: dict[str, str]) -> None:
        argv = [sys.executable, "-m", "shardserve", "serve", *([model] if model else []),
                "--headless", "--nnodes", "2", "--node-rank", "1", "--master-port", str(port),
                "--dtype", "float32", *flags]
        self.proc = subprocess.Popen(argv, env=env, start_new_session=True,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.pids: set[int] = {self.proc.pid}

    def tree(self) -> set[int]:
        try:
            self.pids |= {c.pid for c in psutil.Process(self.proc.pid).children(recursive=True)}
        except psutil.NoSuchProcess:
            pass
        return self.pids

    def kill_tree(self) -> None:
        self.tree()
        os.killpg(self.proc.pid, signal.SIGKILL)

    def alive(self) -> list[int]:
        alive = []
        for pid in self.pids:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    alive.append(pid)
            except psutil.NoSuchProcess:
                pass
        return alive

    def wait_for_line(self, text: str, timeout: float = 60) -> None:
        if text not in line_with(self.proc, text, timeout):
            raise AssertionError(f"node 1 never said {text!r}")

    def finish(self, timeout: float = 30) -> tuple[int | None, str]:
        try:
            out, _ = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill_tree()
            out, _ = self.proc.communicate()
        return self.proc.returncode, out


def line_with(proc: subprocess.Popen, text: str, timeout: float) -> str:
    """Read `proc`'s output until a line holds `text` (bounded: a hang-catcher); "" if none
    did before the deadline or the end. Reads the pipe's descriptor itself: a text-mode
    readline() after select() can pull the next line into Python's buffer, where select() no
    longer sees it (a secret printed as the second line of one write was missed that way)."""
    assert proc.stdout is not None
    fd, rest = proc.stdout.fileno(), getattr(proc, "unread", b"")
    deadline = time.monotonic() + timeout
    while True:
        while b"\n" in rest:
            line, rest = rest.split(b"\n", 1)
            if text.encode() in line:
                proc.unread = rest  # type: ignore[attr-defined]
                return line.decode(errors="replace") + "\n"
        left = deadline - time.monotonic()
        if left <= 0:
            break
        if select.select([fd], [], [], min(0.5, left))[0]:
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                break
            rest += chunk
    proc.unread = rest  # type: ignore[attr-defined]
    return ""


def node_0_script(text: str, tmp_path: Path, model: Path, port: int,
                  env: dict[str, str]) -> subprocess.Popen:
    """Node 0 as a script of its own (`text`: argv model, port), in a session of its own."""
    script = tmp_path / "node0.py"
    script.write_text(text)
    return subprocess.Popen([sys.executable, str(script), str(model), str(port)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def gone_within(check, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not check():
            return True
        time.sleep(0.05)
    return not check()


@contextlib.contextmanager
def two_nodes(model: Path | None, env: dict[str, str], headless_flags: list[str],
              **llm_kwargs: Any) -> Iterator[tuple[LLM, Headless]]:
    """Node 1 (`--headless` with `headless_flags`) and node 0 (this process's LLM). On a clean
    exit node 1 must have stopped by node 0's request (status 0); otherwise it is killed."""
    port = free_port()
    node1 = Headless(port, str(model) if model else None, *headless_flags, env=env)
    try:
        llm = LLM(str(model) if model else None, dtype="float32", nnodes=2, master_port=port,
                  **llm_kwargs)
        try:
            yield llm, node1
        finally:
            llm.shutdown()
        code, out = node1.finish()
        assert code == 0, out
    finally:
        if node1.proc.poll() is None:
            node1.kill_tree()
            node1.finish()


def _paths(worker) -> dict[str, int]:
    from shardserve.distributed.parallel_state import get_pp_group, get_tp_group

    tp, pp = get_tp_group(), get_pp_group()
    return {"tp_shm": tp.shm_calls, "tp_gloo": tp.fallback_calls, "pp_shm": pp.shm_calls,
            "pp_gloo": pp.fallback_calls}


@pytest.mark.slow
def test_pp2_across_two_nodes_matches_hf(hf_default_greedy, cluster_env, no_leftovers):
    flags = ["--pipeline-parallel-size", "2", "--max-model-len", "512"]
    with two_nodes(None, cluster_env, flags, max_model_len=512,
                   pipeline_parallel_size=2) as (llm, _):
        assert_matches_hf(llm, hf_default_greedy)
        paths = llm.collective_rpc(_paths)
        # Stage 0 -> stage 1 crosses nodes: gloo over TCP, never the shared-memory pipe.
        assert paths[0]["pp_shm"] == 0 and paths[0]["pp_gloo"] > 0, paths


@pytest.fixture(scope="module")
def lora_case(four_layer_model, tmp_path_factory):
    """An adapter of the 4-layer model and uni's outputs through it."""
    lora = tiny_adapter(four_layer_model, tmp_path_factory.mktemp("multinode_lora"))
    return lora, uni_lora_tokens(four_layer_model, lora, LORA_PROMPTS, LORA_GREEDY, 128)


LORA_PROMPTS = ["The quick brown fox", "def add(a, b):"]
LORA_GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (2, 2)], ids=["tp2", "tp2xpp2"])
def test_tiny_model_across_two_nodes_equals_uni(four_layer_model, pp_uni_results, cluster_env,
                                                lora_case, no_leftovers, tp, pp):
    """Also a LoRA adapter on the ranks of both nodes (TP shards, each stage its layers)."""
    tokens, stop_text, want = pp_uni_results
    flags = ["--tensor-parallel-size", str(tp), "--pipeline-parallel-size", str(pp),
             "--max-model-len", "128"]
    with two_nodes(four_layer_model, cluster_env, flags, max_model_len=128, seed=0,
                   tensor_parallel_size=tp, pipeline_parallel_size=pp,
                   **LORA_OPTIONS) as (llm, _):
        assert run_cases(llm, tokens, stop_text) == want
        check_adapter_calls(llm, lora_case[0], LORA_PROMPTS, LORA_GREEDY, lora_case[1])
        paths = llm.collective_rpc(_paths)
        if pp == 1:  # one TP group over both nodes: gloo
            assert paths[0]["tp_shm"] == 0 and paths[0]["tp_gloo"] > 0, paths
        else:  # each stage's TP pair on one node: shared memory; the stages: gloo
            assert paths[0]["tp_shm"] > 0 and paths[0]["pp_gloo"] > 0, paths
            assert paths[0]["pp_shm"] == 0, paths


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


def _pid(worker) -> int:
    return os.getpid()


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


NODE0 = textwrap.dedent("""
    import sys
    from shardserve import LLM, SamplingParams
    if __name__ == "__main__":
        llm = LLM(sys.argv[1], dtype="float32", max_model_len=128, tensor_parallel_size=2,
                  nnodes=2, master_port=int(sys.argv[2]))
        print("STARTED", flush=True)
        params = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)
        while True:
            llm.generate(["hello world"] * 4, params, use_tqdm=False)
""")


def test_headless_node_exits_when_node_0_dies(four_layer_model, cluster_env, tmp_path):
    segments_before = set(our_segments())
    port = free_port()
    node0 = node_0_script(NODE0, tmp_path, four_layer_model, port, cluster_env)
    node1 = Headless(port, str(four_layer_model), "--tensor-parallel-size", "2",
                     "--max-model-len", "128", env=cluster_env)
    try:
        assert node0.stdout is not None
        lines = []
        for line in node0.stdout:  # bounded by node 0's own start-up deadline
            lines.append(line)
            if "STARTED" in line:
                break
        assert any("STARTED" in x for x in lines), "".join(lines)
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
        for proc in (node0, node1.proc):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert gone_within(lambda: set(our_segments()) - segments_before, 10), our_segments()


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


def test_strangers_on_every_port_of_the_cluster_get_nothing(four_layer_model, cluster_env,
                                                             no_leftovers):
    """The handshake port, the broadcast's TCP port and node 1's reply-queue port get keyed
    and keyless ZMQ strangers and raw junk; every other port either side listens on (torch's
    own: gloo's listeners) gets a raw connection that says nothing. None of them receives
    anything, and the engine's steps take as long with them connected. (torch's rendezvous
    store is closed once every rank is ready.)"""
    flags = ["--tensor-parallel-size", "2", "--max-model-len", "128"]
    strangers_: list = []
    ports_before = _listening_ports({os.getpid()})
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with two_nodes(four_layer_model, cluster_env, flags, max_model_len=128,
                   tensor_parallel_size=2) as (llm, node1):
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
            strangers_ += strangers(f"tcp://127.0.0.1:{llm.config.parallel_config.multinode.master_port}",
                                    zmq.DEALER)
            ours = [llm.config.parallel_config.multinode.master_port,
                    *(int(h.remote_addr.rsplit(":", 1)[1])
                      for h in (rpc.broadcast.export_handle(), rpc.reply_handles[1]))]
            strangers_ += strangers(rpc.broadcast.export_handle().remote_addr)
            strangers_ += strangers(rpc.reply_handles[1].remote_addr)
            others = _listening_ports(_cluster_pids(node1, before)) - ports_before - set(ours)
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
    with pytest.raises(Exception, match="did not connect"):
        LLM(str(four_layer_model), tensor_parallel_size=2, nnodes=2, master_port=port,
            worker_start_timeout_s=5)
    code, out = node1.finish()
    assert code == 1 and "refused this node" in out and "world size 4" in out, out


def test_a_second_node_with_the_same_rank_is_refused(four_layer_model, cluster_env,
                                                     no_leftovers):
    flags = ["--tensor-parallel-size", "2", "--max-model-len", "128"]
    port = free_port()
    twins = [Headless(port, str(four_layer_model), *flags, env=cluster_env) for _ in range(2)]
    try:
        llm = LLM(str(four_layer_model), dtype="float32", max_model_len=128,
                  tensor_parallel_size=2, nnodes=2, master_port=port)
        try:
            assert gone_within(lambda: all(t.proc.poll() is None for t in twins), 30)
            refused = next(t for t in twins if t.proc.poll() is not None)
            code, out = refused.finish()
            assert code == 1 and "node_rank 1 is taken already" in out, out
            assert greedy_tokens(llm)  # the first one serves on
        finally:
            llm.shutdown()
        codes = [t.finish()[0] for t in twins if t is not refused]
        assert codes == [0]
    finally:
        for t in twins:
            if t.proc.poll() is None:
                t.kill_tree()
                t.finish()


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


NODE0_ONCE = textwrap.dedent("""
    import os, sys
    from shardserve import LLM, SamplingParams
    if __name__ == "__main__":
        llm = LLM(sys.argv[1], dtype="float32", max_model_len=128, tensor_parallel_size=2,
                  nnodes=2, master_port=int(sys.argv[2]))
        params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
        out = llm.generate(["hello world"], params, use_tqdm=False)
        print("DONE", len(out[0].outputs[0].token_ids),
              "SHARDSERVE_CLUSTER_SECRET" in os.environ, flush=True)
        llm.shutdown()
""")


def test_a_headless_node_joins_with_the_secret_node_0_printed(four_layer_model, cluster_env,
                                                              tmp_path):
    env = {k: v for k, v in cluster_env.items() if k != "SHARDSERVE_CLUSTER_SECRET"}
    port = free_port()
    node0 = node_0_script(NODE0_ONCE, tmp_path, four_layer_model, port, env)
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
        assert node0.wait(timeout=60) == 0
        code, out = node1.finish()
        assert code == 0, out
    finally:
        for proc in (node0, *([node1.proc] if node1 else [])):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
