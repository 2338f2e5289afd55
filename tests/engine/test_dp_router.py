"""The data-parallel router: least loaded by what each replica reported plus what it was sent
since, children of one request kept together, aborts grouped by owner."""

from __future__ import annotations

from shardserve.engine.core_wire import SchedulerStats
from shardserve.engine.dp_router import ReplicaRouter


def test_a_burst_between_reports_is_spread() -> None:
    router = ReplicaRouter(3)
    picks = [router.assign([f"r{i}"]) for i in range(6)]  # no report arrives meanwhile
    assert sorted(picks) == [0, 0, 1, 1, 2, 2]


def test_reported_load_counts_and_included_adds_are_not_counted_twice() -> None:
    router = ReplicaRouter(2)
    for i in range(4):
        router.owner[f"old{i}"] = 0
    router.sent = {0: 4, 1: 0}
    # Replica 0 has taken in all 4 adds and runs them; replica 1 is idle.
    router.on_stats(0, SchedulerStats(num_running=4, requests_added=4))
    assert router.load(0) == 4 and router.load(1) == 0
    assert router.assign(["a"]) == 1
    assert router.load(1) == 1  # sent, not yet reported
    router.on_stats(1, SchedulerStats(num_running=1, requests_added=1))
    assert router.load(1) == 1  # now reported, counted once
    router.on_stats(0, SchedulerStats(num_running=0, requests_added=4))  # its four finished
    assert router.assign(["b"]) == 0


def test_children_stay_together_and_aborts_go_to_owners() -> None:
    router = ReplicaRouter(2)
    first = router.assign(["x#0", "x#1", "x#2"])
    second = router.assign(["y"])
    assert first != second  # x's three children made its replica the busier one
    assert router.by_owner(["x#1", "y", "unknown"]) == {first: ["x#1"], second: ["y"]}
    router.finished(["x#0", "x#1", "x#2"])
    assert router.num_open == 1
    assert router.by_owner(["x#1"]) == {}


def test_plan_scale_drains_the_highest_and_takes_draining_back_first() -> None:
    router = ReplicaRouter(3)
    router.owner["busy"] = 2
    assert router.plan_scale(1) == ([], [0])  # 1 and 2 drain; 0 stays
    assert router.draining == {1, 2}
    assert router.drained() == [1]  # 2 still owns a request
    router.remove_replica(1)
    # Growing to 3: replica 2 (still draining) comes back, one new one takes index 1.
    assert router.plan_scale(3) == ([1], [0])
    assert router.draining == set()
    router.add_replica(1)
    assert router.plan_scale(3) == ([], [0, 1, 2])
