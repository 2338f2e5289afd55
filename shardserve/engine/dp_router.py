"""Which data-parallel replica takes a request, and which replica owns each request id.

Load of replica i = its waiting + running requests as it last reported them, plus the requests
sent to it that the report does not include yet (each report says how many "add" messages the
core had applied: `requests_added`). So a burst of requests arriving between two reports is
spread instead of piling onto the replica that looked idle. Ties go to the replica that was sent
the fewest requests. All children of one request (`n` > 1) go to one replica (they share the
prompt's KV blocks through its prefix cache), and aborts go to the owner.

Recovery (replica_recovery.py): a replica that died is `down` until its restart is ready: it takes
no request, and the requests it owned are handed back (`take_down`) to be moved.

Re-scaling: replicas are keyed by index. A replica being removed is `draining`: it takes no new
request and leaves once it owns none (`drained()` names those ready to stop); a scale-up before
then takes it back instead of starting another.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging

from shardserve.config import EngineConfig, ParallelConfig
from shardserve.engine.core_wire import SchedulerStats

logger = logging.getLogger(__name__)


def check_new_size(pc: ParallelConfig, data_parallel_size: object) -> None:
    """What scale() accepts, for the offline client and the server alike."""
    if not isinstance(data_parallel_size, int) or data_parallel_size < 1:
        raise ValueError(f"data_parallel_size={data_parallel_size!r} must be an int >= 1")
    if pc.multinode.nnodes > 1 and data_parallel_size != pc.data_parallel_size:
        raise ValueError(f"re-scaling an engine that spans nodes (nnodes="
                         f"{pc.multinode.nnodes}) is not "
                         f"built: its ranks are laid out over the nodes at start-up; restart "
                         f"every node with --data-parallel-size {data_parallel_size}")


def resized(config: EngineConfig, data_parallel_size: int) -> EngineConfig:
    """The config new replicas start with after a re-scale."""
    pc = dataclasses.replace(config.parallel_config, data_parallel_size=data_parallel_size)
    return dataclasses.replace(config, parallel_config=pc)


class NoReplicaError(RuntimeError):
    """No replica can take a request now (all asleep)."""


class NoReplicaUpError(NoReplicaError):
    """Every replica that could take a request is down (restarting): wait for one."""


class ReplicaRouter:
    def __init__(self, num_replicas: int) -> None:
        self.stats: dict[int, SchedulerStats] = {}
        self.sent: dict[int, int] = {}
        self.draining: set[int] = set()
        self.asleep: set[int] = set()  # put to sleep: no new request until woken
        self.down: set[int] = set()  # died; restarting (replica_recovery.py)
        self.owner: dict[str, int] = {}
        for i in range(num_replicas):
            self.add_replica(i)

    @property
    def replicas(self) -> list[int]:
        """Every replica, serving or draining, by index."""
        return sorted(self.stats)

    @property
    def serving(self) -> list[int]:
        """Replicas up and not draining (utility calls go to these)."""
        return [i for i in self.replicas if i not in self.draining and i not in self.down]

    def plan_scale(self, size: int) -> tuple[list[int], list[int]]:
        """Re-scale to `size` serving replicas, for the offline client and the server alike:
        the highest serving ones start draining, or draining ones are taken back before any is
        started. Returns the indices to start (the lowest free ones) and the replicas that
        were serving and still are (they take their new share of the cores)."""
        serving = self.serving
        if size < len(serving):
            self.draining.update(serving[size:])
            logger.info("scaling down to %d replicas: %s finish their requests, then stop",
                        size, serving[size:])
            new: list[int] = []
        else:
            for i in sorted(self.draining)[: size - len(serving)]:
                self.draining.discard(i)
            free = (i for i in itertools.count() if i not in self.stats)
            new = list(itertools.islice(free, max(0, size - len(self.serving))))
        return new, [i for i in serving if i in self.serving]

    def add_replica(self, index: int) -> None:
        self.stats[index] = SchedulerStats()
        self.sent[index] = 0

    def remove_replica(self, index: int) -> None:
        """Forget a stopped replica (it owns nothing: see drained())."""
        for table in (self.stats, self.sent):
            table.pop(index, None)
        self.draining.discard(index)
        self.asleep.discard(index)

    def load(self, replica: int) -> int:
        s = self.stats[replica]
        return s.num_waiting + s.num_running + self.sent[replica] - s.requests_added

    def pick(self) -> int:
        awake = [i for i in self.serving if i not in self.asleep]
        if not awake and self.down:
            raise NoReplicaUpError(f"no engine replica is up: {sorted(self.down)} restarting")
        if not awake:
            raise NoReplicaError("every engine replica is asleep; wake one up first (wake_up, "
                                 "or POST /wake_up on the server)")
        return min(awake, key=lambda i: (self.load(i), self.sent[i]))

    def assign(self, request_ids: list[str]) -> int:
        """The replica for one request's children (all of them), recorded as their owner."""
        replica = self.pick()
        for rid in request_ids:
            self.owner[rid] = replica
        self.sent[replica] += len(request_ids)
        return replica

    def take_down(self, replica: int) -> list[str]:
        """A replica died: it takes nothing until `bring_up`; returns the ids it owned (now
        owned by nobody, to be moved)."""
        self.down.add(replica)
        self.stats[replica] = SchedulerStats()  # what it ran is gone (moved)
        owned = [rid for rid, r in self.owner.items() if r == replica]
        for rid in owned:
            del self.owner[rid]
        return owned

    def bring_up(self, replica: int) -> None:
        """Its restart is ready: fresh figures, routed to again."""
        self.down.discard(replica)
        self.asleep.discard(replica)
        self.add_replica(replica)

    def on_stats(self, replica: int, stats: SchedulerStats) -> None:
        if replica in self.stats:
            self.stats[replica] = stats

    def finished(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.owner.pop(rid, None)

    def by_owner(self, request_ids: list[str]) -> dict[int, list[str]]:
        """The ids (still open) grouped by the replica that runs them."""
        groups: dict[int, list[str]] = {}
        for rid in request_ids:
            replica = self.owner.get(rid)
            if replica is not None:
                groups.setdefault(replica, []).append(rid)
        return groups

    def drained(self) -> list[int]:
        """Draining replicas that own no request any more: ready to stop."""
        busy = set(self.owner.values())
        return sorted(i for i in self.draining if i not in busy and i not in self.down)

    @property
    def num_open(self) -> int:
        return len(self.owner)
