from shardserve.errors import EngineDeadError
from shardserve.executor.abstract import Executor

__all__ = ["EngineDeadError", "Executor"]
