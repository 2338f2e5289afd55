"""Worker subclasses for the tests, named in `worker_cls` (imported by worker processes): ones
that fail on purpose, for the fault tests, and one with a method of its own."""

from __future__ import annotations

from shardserve.worker.worker import Worker


class FaultyWorker(Worker):
    """Raises in execute_model on the ranks armed with `arm_fault`."""

    fault_armed = False

    def arm_fault(self, ranks: list[int]) -> None:
        self.fault_armed = self.rank in ranks

    def execute_model(self, scheduler_output):
        if self.fault_armed:
            raise RuntimeError(f"injected fault on rank {self.rank}")
        return super().execute_model(scheduler_output)


class BrokenWeightsWorker(Worker):
    """Rank 1 reads a weight file that cannot be read."""

    def load_model(self) -> None:
        if self.rank == 1:
            with open(self.config.model_config.path / "rank1-weights.safetensors", "rb"):
                pass
        super().load_model()


class MarkedWorker(Worker):
    """A subclass with a method the base class lacks: answers only if it is what was built."""

    def worker_class_name(self) -> str:
        return type(self).__name__
