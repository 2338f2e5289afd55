"""RayDistributedExecutor (`ray`): one Ray actor per rank, driven by Ray itself.

    collective_rpc ──actor.call.remote()──▶ every rank ──ObjectRef──▶ ReplyFuture (rank order)
    execute_model  ──stash the SchedulerOutput (returns None; Executor's, as every backend)
    sample_tokens  ──(scheduler_output, grammar_output)──▶ execute_step on every rank, either
                     as one actor call per rank, or through a Ray Compiled Graph
                     (InputNode ─▶ execute_step per rank ─▶ MultiOutputNode; shared-memory
                     channels on CPU) ─▶ the output rank's ModelRunnerOutput
    with pipeline stages, the graph is a chain per TP rank t (hidden states flow through it):
        InputNode ─▶ stage 0 rank t ─(hidden, residual)─▶ stage 1 rank t ─▶ ... ─▶ last stage

One call per rank per step either way: execute_model and sample_tokens travel together.
Liveness: every actor runs a watch() call in a concurrency group of its own, which ends only
when the actor does (ray_workers.py); its failure is the death signal.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import fields, is_dataclass, replace
from typing import Any

import numpy as np
import ray

from shardserve.errors import EngineDeadError
from shardserve.executor import ray_utils
from shardserve.executor.abstract import Executor
from shardserve.executor.ray_workers import RayWorkerGroup
from shardserve.executor.reply_future import POLL_S, Gather, ReplyFuture
from shardserve.messages import GrammarOutput, ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)

def use_compiled_graph(setting: bool | None, world_size: int) -> bool:
    """None (auto): only where cores outnumber workers, since every compiled-graph reader
    polls its channel and so keeps about a core busy even when idle."""
    if setting is not None:
        return setting
    return len(os.sched_getaffinity(0)) > world_size


class RayDistributedExecutor(Executor):
    supports_early_forward = False  # steps go out whole (see Executor.supports_early_forward)
    uses_ray = True

    def _init_executor(self) -> None:
        pc = self.parallel_config
        self.world_size = pc.world_size
        self._graph: Any = None
        self._step_failed = False  # since then a rank may be stuck in a collective
        self._graph_failure: ray_utils.RemoteFailure | None = None
        self.use_compiled_graph = use_compiled_graph(pc.ray.ray_use_compiled_graph, self.world_size)
        self.group = RayWorkerGroup(self.config, self._mark_failed)
        try:
            self.group.start(pc.worker_start_timeout_s)
            self.group.watch(self.group.lifelines)
        except BaseException:
            self.shutdown()
            raise
        self.actors = self.group.actors
        logger.info(
            "ray executor: model steps through %s",
            "a compiled graph" if self.use_compiled_graph else "actor calls",
        )

    # ---- failure ----
    def _death_cause(self, wait_s: float) -> str | None:
        """The recorded death, or one Ray reports within wait_s (recorded now)."""
        if self._death is None:
            self.group.report_dead(wait_s)
        return self._death

    # ---- collective_rpc through actor calls ----
    def collective_rpc(
        self,
        method: str | Callable[..., Any],
        timeout: float | None = None,
        args: tuple = (),
        kwargs: dict[str, Any] | None = None,
        non_block: bool = False,
        unique_reply_rank: int | None = None,
    ) -> Any:
        self._raise_if_dead()
        # Calls from one caller to one actor run in submission order, so futures of later
        # calls cannot complete before earlier ones.
        refs = [a.call.remote(method, args, kwargs or {}) for a in self.actors]
        return self._future(refs, Gather.of(method, range(len(refs)), timeout, unique_reply_rank),
                            non_block)

    def _future(self, refs: list[Any], gather: Gather, non_block: bool) -> Any:
        """Every rank's value is awaited (the first failure of any rank raises at once), then
        the gather's value: all of them in rank order, or its reply rank's."""

        def receive(missing: list[int], slice_s: float) -> None:
            rank_of = {refs[r]: r for r in missing}
            ready, _ = ray.wait(list(rank_of), num_returns=len(rank_of), timeout=slice_s)
            arrived = [self._value(ref, rank_of[ref]) for ref in ready]
            self._raise_first_failure(arrived, gather.method)
            gather.results.update(zip((rank_of[ref] for ref in ready), arrived, strict=True))

        def fetch(wait_s: float | None) -> Any:
            wait_deadline = None if wait_s is None else time.monotonic() + wait_s
            return gather.wait(receive, wait_deadline, self._raise_if_dead)

        future = ReplyFuture.lazy(fetch, gather.deadline)
        return future if non_block else future.result()

    def _value(self, ref: Any, rank: int) -> Any:
        try:
            return ray.get(ref)
        except ray.exceptions.RayActorError as e:
            raise EngineDeadError(
                self._death_cause(1.0) or self.group.describe(rank, ray_utils.describe_death(e))
            ) from e

    def _raise_first_failure(self, values: list[Any], method: str) -> None:
        """Raise the earliest RemoteFailure among `values`: the others are usually ranks whose
        collective broke because of it."""
        failures = [v for v in values if isinstance(v, ray_utils.RemoteFailure)]
        if failures:
            self._step_failed = self._step_failed or method == "execute_step"
            first = min(failures, key=lambda f: f.failed_at)
            self._raise_remote(first, method)

    def _raise_remote(self, failure: ray_utils.RemoteFailure, method: str) -> None:
        error = failure.error.to_exception(method)
        # A collective broken by a peer's death fails here first: name the cause instead.
        cause = self._death_cause(0.5)
        if cause is not None:
            raise EngineDeadError(cause) from error
        raise error

    # ---- model steps ----
    def _execute_step(
        self,
        scheduler_output: SchedulerOutput,
        grammar_output: GrammarOutput | None,
        non_block: bool,
    ) -> ModelRunnerOutput | Future:
        # One actor call (or graph execution) per rank per step; see the module docstring.
        inputs = (scheduler_output, grammar_output)
        timeout = self.parallel_config.execute_timeout_s
        if self.use_compiled_graph:
            return self._run_graph(inputs, timeout, non_block)
        refs = [a.execute_step.remote(inputs) for a in self.actors]
        gather = Gather.of("execute_step", range(len(refs)), timeout, self.output_rank)
        return self._future(refs, gather, non_block)

    def _run_graph(self, inputs: tuple, timeout: float, non_block: bool) -> Any:
        refs = self._compiled_graph().execute(inputs)
        deadline = time.monotonic() + timeout

        def fetch(_wait_s: float | None) -> Any:
            # A compiled-graph result can be read only once, so a shorter wait of the caller
            # cannot be honoured: the step's own deadline bounds the read.
            try:
                values = ray.get(refs, timeout=max(0.0, deadline - time.monotonic()))
            except ray.exceptions.GetTimeoutError as e:
                raise TimeoutError(f"a compiled-graph step took longer than {timeout} s") from e
            except Exception as e:  # Ray tears the graph down when an actor dies
                if self._graph_failure is not None:  # a rank failed; we stopped the others
                    # Its cause stays the rank's traceback; Ray's error is only the context.
                    raise self._graph_failure.error.to_exception("execute_step")  # noqa: B904
                cause = self._death_cause(1.0)
                if cause is not None:
                    raise EngineDeadError(cause) from e
                raise
            self._raise_first_failure(values, "execute_step")
            return detach(values[self._graph_output_index()])

        future = ReplyFuture.lazy(fetch, deadline)
        return future if non_block else future.result()

    def _compiled_graph(self) -> Any:
        if self._graph is None:
            from ray.dag import DAGContext, InputNode, MultiOutputNode

            ctx = DAGContext.get_current()
            # Ray's default read deadline (10 s) is shorter than a slow model step may be.
            ctx.get_timeout = max(ctx.get_timeout, int(self.parallel_config.execute_timeout_s))
            with InputNode() as step_input:
                dag = MultiOutputNode(self._graph_outputs(step_input))
            self._graph = dag.experimental_compile()
            threading.Thread(
                target=self._watch_graph_failures, name="shardserve-graph-failures", daemon=True
            ).start()
        return self._graph

    def _graph_outputs(self, step_input: Any) -> list[Any]:
        """One node per rank. With pipeline stages, each stage's rank t reads its input pair
        from stage s-1's rank t through the graph's channel, and the outputs are the last
        stage's nodes; else every rank's execute_step."""
        pc = self.parallel_config
        if pc.pipeline_parallel_size == 1:
            return [a.execute_step.bind(step_input) for a in self.actors]
        stages = pc.layout.replica_groups("pp")  # stage s's ranks: column s
        stage_nodes = [self.actors[g[0]].execute_stage.bind(step_input) for g in stages]
        for stage in range(1, pc.pipeline_parallel_size):
            actors = [self.actors[g[stage]] for g in stages]
            stage_nodes = [
                a.execute_stage.bind(step_input, prev)
                for a, prev in zip(actors, stage_nodes, strict=True)
            ]
        return stage_nodes

    def _graph_output_index(self) -> int:
        """Where the output rank's value sits among the graph's outputs."""
        pc = self.parallel_config
        return self.output_rank if pc.pipeline_parallel_size == 1 else 0

    def _watch_graph_failures(self) -> None:
        """A graph step returns only when every rank has, and the peers of a failed rank may
        wait for it in a collective for ever: on the first failure, record it and kill the
        actors (the engine stops after a failed step anyway); the blocked read then ends
        and raises the recorded failure."""
        refs = {a.next_failure.remote(): r for r, a in enumerate(self.actors)}
        while not self._shut_down and ray.is_initialized():
            try:
                ready, _ = ray.wait(list(refs), num_returns=1, timeout=POLL_S * 2)
                if not ready:
                    continue
                failure = ray.get(ready[0])
            except Exception:
                return  # an actor died, or Ray is going away: the death watch reports it
            self._graph_failure = failure
            self._step_failed = True
            self._mark_failed(
                f"the workers were stopped after rank {failure.error.rank} failed a "
                f"compiled-graph step ({failure.error.exc_type}: {failure.error.message})"
            )
            self.group.kill_actors()
            return

    # ---- shutdown (Executor.shutdown: once, under its lock) ----
    def _shutdown(self) -> None:
        self.group.stop_watching()  # the deaths to come are ours
        if self._graph is not None:
            # Teardown waits (30 s) for every rank's graph loop to stop; one stuck in a
            # collective after a failure never does, so then the actors go first.
            killed = self._step_failed or self._death is not None
            if killed:
                self.group.kill_actors()
            _teardown(self._graph, quiet=killed)
            self._graph = None
        self.group.stop()


def _teardown(graph: Any, quiet: bool) -> None:
    # After ray.kill, Ray logs a traceback per actor it could not cancel: expected, so hidden.
    ray_logger = logging.getLogger("ray.dag.compiled_dag_node")
    level = ray_logger.level
    if quiet:
        ray_logger.setLevel(logging.CRITICAL)
    try:
        graph.teardown()
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
