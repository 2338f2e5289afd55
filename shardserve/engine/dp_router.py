"""Which data-parallel replica takes a request, and which replica owns each request id.

Load of replica i = its waiting + running requests as it last reported them, plus the requests
sent to it that the report does not include yet (each report says how many "add" messages the
core had applied: `requests_added`). So a burst of requests arriving between two reports is
spread instead of piling onto the replica that looked idle. Ties go to the replica that was sent
the fewest requests. All children of one request (`n` > 1) go to one replica (they share the
prompt's KV blocks through its prefix cache), and aborts go to the owner.
"""

from __future__ import annotations

from shardserve.engine.core_proc import SchedulerStats


class ReplicaRouter:
    def __init__(self, num_replicas: int) -> None:
        self.num_replicas = num_replicas
        self.stats = [SchedulerStats() for _ in range(num_replicas)]
        self.sent = [0] * num_replicas
        self.owner: dict[str, int] = {}

    def load(self, replica: int) -> int:
        s = self.stats[replica]
        return s.num_waiting + s.num_running + self.sent[replica] - s.requests_added

    def pick(self) -> int:
        return min(range(self.num_replicas), key=lambda i: (self.load(i), self.sent[i]))

    def assign(self, request_ids: list[str]) -> int:
        """The replica for one request's children (all of them), recorded as their owner."""
        replica = self.pick() if self.num_replicas > 1 else 0
        for rid in request_ids:
            self.owner[rid] = replica
        self.sent[replica] += len(request_ids)
        return replica

    def on_stats(self, replica: int, stats: SchedulerStats) -> None:
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

    @property
    def num_open(self) -> int:
        return len(self.owner)
