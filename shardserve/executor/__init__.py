from shardserve.executor.abstract import EngineDeadError, Executor

__all__ = ["EngineDeadError", "Executor"]
