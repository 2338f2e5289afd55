"""Two Ray nodes on this machine (ray.cluster_utils.Cluster): one rank per node.

Each node has 1 logical CPU and one `rank_slot`, and every bundle asks for both, so a TP=2
engine must put its ranks on different nodes. The engine joins through `ray_address` (it does
not initialise Ray here), so its shutdown must disconnect without stopping the cluster.
"""

from __future__ import annotations

import pytest

ray = pytest.importorskip("ray")

from ray.cluster_utils import Cluster  # noqa: E402
from ray_helpers import (  # noqa: E402
    assert_no_ray_processes,
    nothing_left,
    our_segments,
    ray_env,
    restore_faulthandler,
)

from shardserve import LLM, SamplingParams  # noqa: E402

PROMPTS = ["The quick brown fox", "def add(a, b):", "Hello, world! How are", "Tensor parallel"]
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
NODE = dict(num_cpus=1, resources={"rank_slot": 1}, object_store_memory=100 * 2**20)


@pytest.fixture(scope="module")
def two_nodes():
    with ray_env() as tmp:
        cluster = Cluster(
            initialize_head=True,
            head_node_args=dict(NODE, temp_dir=tmp, include_dashboard=False),
        )
        try:
            cluster.add_node(**NODE)
            cluster.wait_for_nodes()
            yield cluster
        finally:
            ray.shutdown()
            cluster.shutdown()
            assert_no_ray_processes()


def _tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module")
def uni_tokens(tiny_llama_dir) -> list[list[int]]:
    llm = LLM(str(tiny_llama_dir), dtype="float32", max_model_len=256)
    try:
        return _tokens(llm)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("backend", ["ray_v2", "ray"])
def test_one_rank_per_node(two_nodes, tiny_llama_dir, uni_tokens, backend):
    assert not ray.is_initialized()
    before = our_segments()
    llm = LLM(
        str(tiny_llama_dir),
        dtype="float32",
        max_model_len=256,
        tensor_parallel_size=2,
        distributed_executor_backend=backend,
        ray_address=two_nodes.address,
        ray_bundle_resources={"rank_slot": 1},
        ray_use_compiled_graph=False,
    )
    executor = llm.engine.core.executor
    try:
        info = executor.group.info
        driver_node = executor.group.placement.driver_node
        assert info[0]["node_id"] == driver_node  # the driver's node takes the first ranks
        assert info[1]["node_id"] != driver_node
        assert [n for n in executor.group.placement.nodes] == [i["node_id"] for i in info]
        if backend == "ray_v2":
            # The remote rank is not a local reader: it gets the broadcast over TCP.
            assert executor.rpc.broadcast.n_local_reader == 1
            live = ray.get([a.info.remote() for a in executor.group.actors])
            assert [i["broadcast"] for i in live] == ["shared memory", "tcp"]
            assert executor.rpc.reply_handles[1].shm_name is None
        assert _tokens(llm) == uni_tokens
    finally:
        llm.shutdown()
    # The engine joined a cluster it did not start: it disconnected and left the cluster up.
    assert not ray.is_initialized()
    ray.init(address=two_nodes.address)
    restore_faulthandler()
    try:
        assert len([n for n in ray.nodes() if n["Alive"]]) == 2
        nothing_left(before)
    finally:
        ray.shutdown()
