"""One model step as a Ray Compiled Graph over the worker actors (the `ray` backend, when
`ray_use_compiled_graph` or the core count says so).

    InputNode ─▶ execute_step per rank ─▶ MultiOutputNode    (shared-memory channels on CPU)
    with pipeline stages, a chain per TP rank t (hidden states flow through the channels):
        InputNode ─▶ stage 0 rank t ─(hidden, residual)─▶ stage 1 rank t ─▶ ... ─▶ last stage

A graph step returns only when every rank has, and the peers of a failed rank may wait for it
in a collective for ever: a thread waits on every actor's next_failure() and, on the first
failure, records it and hands it to the executor (which kills the actors, so the blocked read
ends and raises the recorded failure).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import fields, is_dataclass, replace
from typing import Any, NoReturn

import numpy as np
import ray

from shardserve.config import ParallelConfig
from shardserve.errors import EngineDeadError
from shardserve.executor.ray.actor import RemoteFailure
from shardserve.executor.reply_future import POLL_S

logger = logging.getLogger(__name__)


def use_compiled_graph(setting: bool | None, world_size: int) -> bool:
    """None (auto): only where cores outnumber workers, since every compiled-graph reader
    polls its channel and so keeps about a core busy even when idle."""
    if setting is not None:
        return setting
    return len(os.sched_getaffinity(0)) > world_size


class CompiledStepGraph:
    def __init__(self, actors: list[Any], pc: ParallelConfig,
                 on_failure: Callable[[RemoteFailure], None]) -> None:
        from ray.dag import DAGContext, InputNode, MultiOutputNode

        self._actors = actors
        self._pc = pc
        self.failure: RemoteFailure | None = None  # the first rank's failure, once one failed
        self._stopped = False
        ctx = DAGContext.get_current()
        # Ray's default read deadline (10 s) is shorter than a slow model step may be.
        ctx.get_timeout = max(ctx.get_timeout, int(pc.execute_timeout_s))
        with InputNode() as step_input:
            dag = MultiOutputNode(self._outputs(step_input))
        self._graph = dag.experimental_compile()
        threading.Thread(target=self._watch_failures, args=(on_failure,),
                         name="shardserve-graph-failures", daemon=True).start()

    def _outputs(self, step_input: Any) -> list[Any]:
        """One node per rank. With pipeline stages, each stage's rank t reads its input pair
        from stage s-1's rank t through the graph's channel, and the outputs are the last
        stage's nodes; else every rank's execute_step."""
        pc = self._pc
        if pc.pipeline_parallel_size == 1:
            return [a.execute_step.bind(step_input) for a in self._actors]
        stages = pc.layout.replica_groups("pp")  # stage s's ranks: column s
        stage_nodes = [self._actors[g[0]].execute_stage.bind(step_input) for g in stages]
        for stage in range(1, pc.pipeline_parallel_size):
            actors = [self._actors[g[stage]] for g in stages]
            stage_nodes = [
                a.execute_stage.bind(step_input, prev)
                for a, prev in zip(actors, stage_nodes, strict=True)
            ]
        return stage_nodes

    @property
    def output_index(self) -> int:
        """Where the output rank's value sits among the graph's outputs."""
        pc = self._pc
        return pc.layout.output_rank if pc.pipeline_parallel_size == 1 else 0

    def execute(self, inputs: tuple, death_cause: Callable[[float], str | None]) -> Any:
        """Start one step; its refs, for `read`. An actor's death can close the graph's input
        channel before its watcher has told anyone (RayChannelError on the write): that is the
        same death as a failed read, and is raised as one."""
        try:
            return self._graph.execute(inputs)
        except Exception as e:
            self._raise_why_it_failed(e, death_cause)

    def read(self, refs: Any, deadline: float, timeout: float,
             death_cause: Callable[[float], str | None]) -> list[Any]:
        """Every output of one step. A compiled-graph result can be read only once, so a
        shorter wait of the caller cannot be honoured: the step's own deadline bounds the read."""
        try:
            return ray.get(refs, timeout=max(0.0, deadline - time.monotonic()))
        except ray.exceptions.GetTimeoutError as e:
            raise TimeoutError(f"a compiled-graph step took longer than {timeout} s") from e
        except Exception as e:  # Ray tears the graph down when an actor dies
            self._raise_why_it_failed(e, death_cause)

    def _raise_why_it_failed(self, error: Exception,
                             death_cause: Callable[[float], str | None]) -> NoReturn:
        if self.failure is not None:  # a rank failed; the others were stopped
            # Its cause stays the rank's traceback; Ray's error (being handled by the caller)
            # is only the context.
            raise self.failure.error.to_exception("execute_step")
        cause = death_cause(1.0)
        if cause is not None:
            raise EngineDeadError(cause) from error
        raise error

    def _watch_failures(self, on_failure: Callable[[RemoteFailure], None]) -> None:
        refs = {a.next_failure.remote(): r for r, a in enumerate(self._actors)}
        while not self._stopped and ray.is_initialized():
            try:
                ready, _ = ray.wait(list(refs), num_returns=1, timeout=POLL_S * 2)
                if not ready:
                    continue
                failure = ray.get(ready[0])
            except Exception:
                return  # an actor died, or Ray is going away: the death watch reports it
            self.failure = failure
            on_failure(failure)
            return

    def teardown(self, quiet: bool) -> None:
        """Stop the graph (waits up to 30 s for every rank's graph loop). quiet: the actors
        were killed first, and the tracebacks Ray logs for each are expected: hidden."""
        self._stopped = True
        ray_logger = logging.getLogger("ray.dag.compiled_dag_node")
        level = ray_logger.level
        if quiet:
            ray_logger.setLevel(logging.CRITICAL)
        try:
            self._graph.teardown()
        except Exception as e:
            logger.warning("compiled graph teardown failed: %s", e)
        finally:
            ray_logger.setLevel(level)


def detach(output: Any) -> Any:
    """Copy read-only numpy arrays (zero-copy views into a compiled graph's shared-memory
    channel) so that holding an output does not pin the channel's buffer."""
    if not is_dataclass(output) or isinstance(output, type):
        return output
    changes = {
        f.name: np.array(v)
        for f in fields(output)
        if isinstance(v := getattr(output, f.name), np.ndarray) and not v.flags.writeable
    }
    return replace(output, **changes) if changes else output
