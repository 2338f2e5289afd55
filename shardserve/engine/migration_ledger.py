"""Which moved requests to blame for engine deaths, and when each may go back in.

A request that crashes its engine (a kernel bug its input hits, a grammar that blows up) kills
every replica it is moved to; the requests beside it die with it through no fault of theirs. A
death is charged to a request (a "strike") only if it had produced nothing since it was last
sent: a request that makes progress was not what killed the engine then. A request with a strike
is a suspect: suspects go back one at a time, each on probation until it produces a token, and a
death during a probation is charged to the request on probation alone. A request with more than
`max_request_migrations` strikes is given up (failed, its id logged).

    death ─▶ strikes (stalled requests, or the one on probation) ─▶ > max: give up
                                                                 ─▶ >= 1: held as a suspect
                                                                 ─▶ else: moved at once
    a token from the request on probation ─▶ the next suspect goes in, on probation

So a poison request among innocent ones is isolated within two deaths and failed after its
strikes, while the others finish; a random death (a node lost, the OOM killer) lands on requests
that were making progress and charges nobody.
"""

from __future__ import annotations

import collections
from collections.abc import Callable


class MigrationLedger:
    def __init__(self, max_request_migrations: int) -> None:
        self.max_strikes = max_request_migrations
        self.strikes: collections.Counter[str] = collections.Counter()
        self.moves: collections.Counter[str] = collections.Counter()
        self._sent_at: dict[str, int] = {}  # request id -> its tokens when last sent
        self.suspects: collections.deque[str] = collections.deque()
        self.probation: str | None = None

    def sent(self, request_id: str, tokens: int) -> None:
        self._sent_at[request_id] = tokens

    def forget(self, request_id: str) -> None:
        """It finished (or was aborted, or given up)."""
        for table in (self.strikes, self.moves, self._sent_at):
            table.pop(request_id, None)
        if request_id in self.suspects:
            self.suspects.remove(request_id)
        if self.probation == request_id:
            self.probation = None

    def on_death(self, request_ids: list[str], tokens: Callable[[str], int]
                 ) -> tuple[list[str], list[str]]:
        """The requests of a replica that died (held suspects among them are skipped). Returns
        (give up, move now); the rest are held as suspects (`release`). `tokens(id)`: what it
        has produced by now."""
        blamed = self.probation if self.probation in request_ids else None
        if blamed is not None:
            self.probation = None
        give_up, move = [], []
        for rid in request_ids:
            if rid in self.suspects:
                continue  # held back: it was not on the engine
            self.moves[rid] += 1
            stalled = tokens(rid) <= self._sent_at.get(rid, -1)
            charged = rid == blamed or (blamed is None and stalled)
            self.strikes[rid] += charged
            if self.strikes[rid] > self.max_strikes:
                give_up.append(rid)
            elif charged:
                self.suspects.append(rid)
            else:
                move.append(rid)
        for rid in give_up:
            self.forget(rid)
        return give_up, move

    def release(self, tokens: Callable[[str], int | None]) -> str | None:
        """The next suspect to send, once no request is on probation (the one that was made
        progress, ended or was forgotten); it is on probation from now."""
        if self.probation is not None:
            now = tokens(self.probation)
            if now is not None and now <= self._sent_at.get(self.probation, -1):
                return None
            self.probation = None
        if not self.suspects:
            return None
        self.probation = self.suspects.popleft()
        return self.probation
