"""A Worker whose model steps the test lets through one by one (imported by worker processes).

Why: the tiny model generates hundreds of tokens in well under a second, so "start a long request,
then disconnect while it runs" is a race a loaded machine loses. With the gate the test decides
how many steps may start; a request held at the gate is provably unfinished, however slow or fast
the machine. See `StepGate` in server_helpers.py for the test's side.

Protocol (files, so it needs no extra sockets): $SHARDSERVE_TEST_STEP_GATE names a file holding
how many execute_model calls may start in total (absent: no limit); each rank records how many
it started in `<gate>.rank<R>`.
"""

from __future__ import annotations

import os
import time
from typing import Any

from shardserve.worker.worker import Worker

_POLL_S = 0.002
_GIVE_UP_S = 300.0  # a test that died without opening the gate must not wedge a worker forever


def allowed_steps(gate: str) -> float:
    try:
        with open(gate) as f:
            return float(f.read())
    except FileNotFoundError:  # no gate set up: every step may run
        return float("inf")


def write_atomically(path: str, text: str) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


class GatedWorker(Worker):
    started = 0

    def execute_model(self, *args: Any, **kwargs: Any) -> Any:
        gate = os.environ.get("SHARDSERVE_TEST_STEP_GATE")
        if gate:
            give_up = time.monotonic() + _GIVE_UP_S
            while allowed_steps(gate) <= self.started and time.monotonic() < give_up:
                time.sleep(_POLL_S)
            self.started += 1
            write_atomically(f"{gate}.rank{self.rank}", str(self.started))
        return super().execute_model(*args, **kwargs)
