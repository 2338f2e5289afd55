"""The scheduling policy: in which order waiting requests are admitted, and which running request
a full KV cache preempts first (vLLM's `scheduling_policy`).

    fcfs      admitted in arrival order; a preempted request goes back to the front; the most
              recently admitted running request is preempted first.
    priority  admitted by (priority, arrival) — lower value first, ties by arrival; a preempted
              request takes its place by that key again; the running request with the highest
              (priority, arrival), the least important and latest, is preempted first.

The scheduler always preempts `running[-1]`, so the policy also decides where an admitted request
goes in the running list: appended (fcfs), or inserted in key order (priority). Keeping the list
ordered (rather than searching it for the victim) means the victim has never been scheduled yet
in the step that preempts it — the scheduler walks the running list front to back, so the token
budget too goes to the most important first — and nothing already planned has to be undone.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
from collections import deque
from collections.abc import Iterator

from shardserve.config.engine import SCHEDULING_POLICIES
from shardserve.engine.request import Request


class RequestQueue:
    """The waiting requests, in admission order (the interface both policies implement)."""

    def add(self, request: Request) -> None:
        """A newly arrived request."""
        raise NotImplementedError

    def put_back(self, requests: list[Request]) -> None:
        """Requests taken out again (preempted, or passed over this step), in their order."""
        raise NotImplementedError

    def peek(self) -> Request:
        """The next request to admit (the queue must not be empty)."""
        raise NotImplementedError

    def pop(self) -> Request:
        raise NotImplementedError

    def remove(self, request: Request) -> None:
        raise NotImplementedError

    def place_running(self, running: list[Request], request: Request) -> None:
        """Put an admitted request in the running list, whose last entry is preempted first."""
        running.append(request)

    def __contains__(self, request: object) -> bool:
        raise NotImplementedError

    def __len__(self) -> int:
        raise NotImplementedError

    def __iter__(self) -> Iterator[Request]:
        """Every waiting request (in no particular order)."""
        raise NotImplementedError

    def __bool__(self) -> bool:
        return len(self) > 0


class FCFSQueue(RequestQueue):
    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._queue.append(request)

    def put_back(self, requests: list[Request]) -> None:
        # Ahead of everything that arrived since: they were admitted (or due) first.
        self._queue.extendleft(reversed(requests))

    def peek(self) -> Request:
        return self._queue[0]

    def pop(self) -> Request:
        return self._queue.popleft()

    def remove(self, request: Request) -> None:
        self._queue.remove(request)

    def __contains__(self, request: object) -> bool:
        return request in self._queue

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


def priority_key(request: Request) -> tuple[int, float]:
    return request.priority, request.arrival_time


class PriorityQueue(RequestQueue):
    """A binary heap on (priority, arrival, insertion count); O(log n) per add and pop. A removed
    (aborted) request is dropped lazily when it reaches the top: an entry is live only while
    `_live` maps its request to that entry's count."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._live: dict[Request, int] = {}
        self._count = itertools.count()  # equal keys (same arrival stamp) leave in insertion order

    def add(self, request: Request) -> None:
        seq = next(self._count)
        self._live[request] = seq
        heapq.heappush(self._heap, (*priority_key(request), seq, request))

    def put_back(self, requests: list[Request]) -> None:
        for request in requests:
            self.add(request)

    def peek(self) -> Request:
        self._drop_dead()
        return self._heap[0][-1]

    def pop(self) -> Request:
        self._drop_dead()
        request = heapq.heappop(self._heap)[-1]
        del self._live[request]
        return request

    def remove(self, request: Request) -> None:
        del self._live[request]

    def place_running(self, running: list[Request], request: Request) -> None:
        # After any equal key: of two requests alike, the later admitted is preempted first.
        bisect.insort_right(running, request, key=priority_key)

    def _drop_dead(self) -> None:
        heap = self._heap
        while heap and self._live.get(heap[0][-1]) != heap[0][2]:
            heapq.heappop(heap)

    def __contains__(self, request: object) -> bool:
        return request in self._live

    def __len__(self) -> int:
        return len(self._live)

    def __iter__(self) -> Iterator[Request]:
        return iter(list(self._live))


def make_request_queue(policy: str) -> RequestQueue:
    if policy == "priority":
        return PriorityQueue()
    if policy == "fcfs":
        return FCFSQueue()
    raise ValueError(f"scheduling_policy={policy!r} is not supported; choose one of: "
                     f"{', '.join(SCHEDULING_POLICIES)}")
