"""A worker that dies as a crash would (SIGKILL), for the recovery tests (named in `worker_cls`;
imported by worker processes: tests/ is on their path, or on PYTHONPATH for a server)."""

from __future__ import annotations

import os
import signal

from shardserve.worker.worker import Worker

# A request with this seed kills every worker that schedules it (a request that kills engines).
POISON_SEED = 4242424


class SuicidalWorker(Worker):
    """SIGKILLs itself on rank 1 (rank 0 without TP) at its 5th model step once per marker file
    ($SHARDSERVE_TEST_DIE_ONCE names it: the restarted engine finds it and lives), and on any
    rank that schedules a request seeded POISON_SEED."""

    steps = 0

    def execute_model(self, scheduler_output):
        self.steps += 1
        poisoned = any(r.sampling_params.seed == POISON_SEED
                       for r in scheduler_output.scheduled_new_reqs)
        if poisoned or self._dies_once():
            os.kill(os.getpid(), signal.SIGKILL)
        return super().execute_model(scheduler_output)

    def _dies_once(self) -> bool:
        marker = os.environ.get("SHARDSERVE_TEST_DIE_ONCE")
        victim = 1 if self.config.parallel_config.tensor_parallel_size > 1 else 0
        if not marker or self.rank != victim or self.steps < 5 or os.path.exists(marker):
            return False
        with open(marker, "w"):
            pass
        return True
