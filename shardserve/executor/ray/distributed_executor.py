"""RayDistributedExecutor (`ray`): one Ray actor per rank, driven by Ray itself.

    collective_rpc ──actor.call.remote()──▶ every rank ──ObjectRef──▶ ReplyFuture (rank order)
    execute_model  ──stash the SchedulerOutput (returns None; Executor's, as every backend)
    sample_tokens  ──(scheduler_output, grammar_output)──▶ execute_step on every rank, either
                     as one actor call per rank, or through a Ray Compiled Graph
                     (compiled_graph.py) ─▶ the output rank's ModelRunnerOutput

One call per rank per step either way: execute_model and sample_tokens travel together.
Liveness: every actor runs a watch() call in a concurrency group of its own, which ends only
when the actor does (worker_group.py); its failure is the death signal.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import ray

from shardserve.errors import EngineDeadError
from shardserve.executor.abstract import Executor
from shardserve.executor.ray.actor import RemoteFailure
from shardserve.executor.ray.compiled_graph import CompiledStepGraph, detach, use_compiled_graph
from shardserve.executor.ray.worker_group import RayWorkerGroup, describe_death
from shardserve.executor.reply_future import Gather, ReplyFuture
from shardserve.messages import GrammarOutput, ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)


class RayDistributedExecutor(Executor):
    supports_early_forward = False  # steps go out whole (see Executor.supports_early_forward)
    uses_ray = True

    def _init_executor(self) -> None:
        pc = self.parallel_config
        self.world_size = pc.world_size
        self._graph: CompiledStepGraph | None = None  # built at the first step
        self._step_failed = False  # since then a rank may be stuck in a collective
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
                self._death_cause(1.0) or self.group.describe(rank, describe_death(e))
            ) from e

    def _raise_first_failure(self, values: list[Any], method: str) -> None:
        """Raise the earliest RemoteFailure among `values`: the others are usually ranks whose
        collective broke because of it."""
        failures = [v for v in values if isinstance(v, RemoteFailure)]
        if failures:
            self._step_failed = self._step_failed or method == "execute_step"
            first = min(failures, key=lambda f: f.failed_at)
            self._raise_remote(first, method)

    def _raise_remote(self, failure: RemoteFailure, method: str) -> None:
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
        if self._graph is None:
            self._graph = CompiledStepGraph(self.actors, self.parallel_config,
                                            self._on_graph_failure)
        graph = self._graph
        refs = graph.execute(inputs, self._death_cause)
        deadline = time.monotonic() + timeout

        def fetch(_wait_s: float | None) -> Any:  # the step's deadline bounds it (see read)
            values = graph.read(refs, deadline, timeout, self._death_cause)
            self._raise_first_failure(values, "execute_step")
            return detach(values[graph.output_index])

        future = ReplyFuture.lazy(fetch, deadline)
        return future if non_block else future.result()

    def _on_graph_failure(self, failure: RemoteFailure) -> None:
        """A rank failed a graph step (from the graph's watch thread): its peers may wait for
        it in a collective for ever, so kill the actors (the engine stops after a failed step
        anyway); the blocked read then ends and raises the failure."""
        if self._shut_down:
            return  # the shutdown under way stops the actors
        self._step_failed = True
        # The step's own read raises the rank's exception; a call made meanwhile (the next
        # step, under async scheduling) raises this, which names the rank just as well.
        error = failure.error.to_exception("execute_step")
        self._mark_failed(f"the workers were stopped after a compiled-graph step: {error}",
                          cause=error.__cause__)
        self.group.kill_actors()

    # ---- shutdown (Executor.shutdown: once, under its lock) ----
    def _shutdown(self) -> None:
        self.group.stop_watching()  # the deaths to come are ours
        if self._graph is not None:
            # Teardown waits (30 s) for every rank's graph loop to stop; one stuck in a
            # collective after a failure never does, so then the actors go first.
            killed = self._step_failed or self._death is not None
            if killed:
                self.group.kill_actors()
            self._graph.teardown(quiet=killed)
            self._graph = None
        self.group.stop()
