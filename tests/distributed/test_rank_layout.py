"""RankLayout reproduces vLLM's group lists and the multi-node placement."""

from __future__ import annotations

import pytest

from shardserve.config import MultiNodeConfig, ParallelConfig
from shardserve.distributed.rank_layout import RankCoords, RankLayout


def test_dcp_groups_span_tp_and_pcp():
    assert RankLayout(tp=2, pcp=2, dcp=2).dcp_groups() == [[0, 2], [1, 3]]
    assert RankLayout(tp=2, pcp=2, dcp=4).dcp_groups() == [[0, 2, 1, 3]]
    assert RankLayout(tp=4, pcp=2, dcp=2).dcp_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_dcp_without_pcp_splits_each_tp_group():
    assert RankLayout(tp=4, dcp=2).dcp_groups() == [[0, 1], [2, 3]]
    assert RankLayout(tp=4, pp=2, dcp=4).dcp_groups() == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_tp_pp_dp_groups_of_dp2_pp2_tp2():
    layout = RankLayout(tp=2, pp=2, dp=2)
    assert layout.tp_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.pp_groups() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.dp_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layout.pcp_groups() == [[r] for r in range(8)]
    assert layout.replica_groups("tp") == [[0, 1], [2, 3]]
    assert layout.replica_groups("pp") == [[0, 2], [1, 3]]


def test_pcp_groups_and_coordinates():
    layout = RankLayout(tp=2, pcp=2, pp=2)
    assert layout.pcp_groups() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.pp_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layout.coords(6) == RankCoords(dp=0, pp=1, pcp=1, tp=0)
    assert all(layout.rank_of(**vars(layout.coords(r))) == r for r in range(layout.total))
    assert layout.group_of("pcp", 5) == [5, 7]


def test_output_rank_is_first_rank_of_last_stage():
    assert RankLayout().output_rank == 0
    assert RankLayout(tp=3).output_rank == 0
    assert RankLayout(tp=2, pp=3).output_rank == 4
    assert RankLayout(tp=2, pcp=2, pp=2).output_rank == 4


def test_describe():
    assert RankLayout(tp=2).describe(1, "pid 7") == "rank 1 (pid 7)"
    assert RankLayout(tp=2, pp=2).describe(3, "pid 7") == "rank 3 (stage 1, TP rank 1, pid 7)"


def test_multinode_layout_is_node_major_over_replicas():
    # DP=2 x TP=2 over 2 nodes: each replica on a node of its own.
    layout = RankLayout(tp=2, dp=2, nnodes=2)
    assert layout.ranks_per_node == 2
    assert [layout.node_of(r, 0) for r in range(2)] == [0, 0]
    assert [layout.node_of(r, 1) for r in range(2)] == [1, 1]
    assert [layout.local_rank_of(r, 1) for r in range(2)] == [0, 1]
    assert layout.ranks_on_node(1, 0) == ()
    # TP=2 x PP=2 over 2 nodes: one stage per node; rank 3 is node 1's second device.
    layout = RankLayout(tp=2, pp=2, nnodes=2)
    assert layout.nodes_of_replica() == [0, 0, 1, 1]
    assert layout.ranks_on_node(1) == (2, 3)
    assert layout.local_rank_of(3) == 1
    # DP=2 x TP=2 on one node: replica 1's ranks are that node's devices 2 and 3.
    assert [RankLayout(tp=2, dp=2).local_rank_of(r, 1) for r in range(2)] == [2, 3]


def test_parallel_config_hands_out_its_layout():
    pc = ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=2,
                        distributed_executor_backend="mp", data_parallel_size=2,
                        multinode=MultiNodeConfig(nnodes=2))
    layout = pc.layout
    assert (layout.tp, layout.pp, layout.dp, layout.nnodes) == (2, 2, 2, 2)
    assert layout.ranks_on_node(1, replica=1) == (0, 1, 2, 3)


@pytest.mark.parametrize("kwargs, fragment", [
    ({"tp": 0}, "tp=0"),
    ({"tp": 3, "dcp": 2}, "decode context parallel size 2"),
    ({"tp": 3, "nnodes": 2}, "nnodes=2 must divide"),
])
def test_bad_layouts_are_refused(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        RankLayout(**kwargs)
