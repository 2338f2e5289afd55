"""ExternalLauncherExecutor: an outside launcher (torchrun) starts one process per rank and every
process runs the whole engine; this executor drives the one worker of its own process.

    torchrun --standalone --nproc-per-node 2 script.py
    # script.py: LLM(..., tensor_parallel_size=2, distributed_executor_backend="external_launcher")

There is no broadcast: each rank's engine schedules the same requests in the same order and each
worker samples the same tokens (identical logits after the vocab all-gather, identically seeded
generators), so the engines stay in lockstep and every rank returns the same outputs. Two things
could break the lockstep, and are settled here across ranks: the KV-cache size (each rank's free
memory differs, so all take the minimum) and the world size (it must match the launcher's).
Feed every rank the same prompts and sampling parameters.

With pipeline stages only the last stage samples, so after each step the output rank
broadcasts its ModelRunnerOutput to every rank (one small gloo broadcast per step) and every
engine folds in the same tokens. That broadcast makes each rank wait for the whole pipeline
every step: stages take turns rather than overlap (correct, not fast; use mp for speed).
"""

from __future__ import annotations

import os
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist

from shardserve.executor.uniproc import UniProcExecutor
from shardserve.messages import GrammarOutput, ModelRunnerOutput, SchedulerOutput
from shardserve.worker.build import build_worker
from shardserve.worker.worker import Worker, run_method

_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def launcher_env() -> tuple[int, int, int, int]:
    """(rank, local_rank, world_size, local_world_size) from torchrun's environment."""
    missing = [name for name in _ENV if name not in os.environ]
    if missing:
        raise RuntimeError(
            f"distributed_executor_backend='external_launcher' needs {', '.join(missing)} in the "
            f"environment, which torchrun sets: run the script with `torchrun --nproc-per-node "
            f"N script.py` (N = tensor_parallel_size x pipeline_parallel_size x "
            f"prefill_context_parallel_size), or choose the 'mp' backend"
        )
    world = int(os.environ["WORLD_SIZE"])
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    return rank, local_rank, world, int(os.environ.get("LOCAL_WORLD_SIZE", world))


class ExternalLauncherExecutor(UniProcExecutor):
    supports_early_forward = False  # steps go out whole (see Executor.supports_early_forward)

    def _build_worker(self) -> Worker:
        rank, local_rank, world, local_world = launcher_env()
        expected = self.parallel_config.world_size
        if world != expected:
            raise ValueError(
                f"the launcher started {world} processes (WORLD_SIZE={world}) but "
                f"{self.parallel_config.world_formula} = {expected}; make them equal"
            )
        return build_worker(
            self.config, rank=rank, local_rank=local_rank,
            distributed_init_method="env://", local_world_size=local_world,
        )  # fmt: skip

    def determine_available_memory(self) -> list[int]:
        # Every rank must build the same number of KV blocks, or the schedulers diverge.
        local = super().determine_available_memory()
        if self.parallel_config.world_size == 1:
            return local

        def agree() -> int:
            smallest = torch.tensor(min(local), dtype=torch.int64, device=self.worker.device)
            dist.all_reduce(smallest, op=dist.ReduceOp.MIN)
            return int(smallest.item())

        # On the worker's thread: the process group's collectives stay on one thread.
        return [self._on_worker_thread(agree)]

    def _every_rank(self, method: str, args: tuple) -> list[Any]:
        """Every rank's answer (each process reaches only its own worker): the ranks gather
        them, errors included, so that a rank that fails never leaves the others waiting in
        the gather; each then raises the same way (its own exception, or the first rank's)."""
        if self.parallel_config.world_size == 1:
            return super()._every_rank(method, args)

        def gather(worker: Worker) -> list[tuple[bool, Any]]:
            try:
                mine: tuple[bool, Any] = (True, run_method(worker, method, args, {}))
            except Exception as e:  # noqa: BLE001 - shared with the other ranks, then raised
                mine = (False, e)
            every: list[Any] = [None] * self.parallel_config.world_size
            dist.all_gather_object(every, mine if mine[0] else (False, repr(mine[1])))
            if not mine[0]:
                raise mine[1]
            return every

        every = self.collective_rpc(gather, unique_reply_rank=0)
        failed = [(rank, why) for rank, (ok, why) in enumerate(every) if not ok]
        if failed:
            raise RuntimeError(f"{method}() failed on rank {failed[0][0]}: {failed[0][1]}")
        return [value for _, value in every]

    def _execute_step(
        self,
        scheduler_output: SchedulerOutput,
        grammar_output: GrammarOutput | None,
        non_block: bool,
    ) -> ModelRunnerOutput | Future:
        if self.parallel_config.pipeline_parallel_size == 1:  # every rank samples the same
            return super()._execute_step(scheduler_output, grammar_output, non_block)
        src = self.output_rank

        def step_and_share(worker: Worker) -> ModelRunnerOutput:
            output = worker.execute_step(scheduler_output, grammar_output)
            box = [output if worker.rank == src else None]
            dist.broadcast_object_list(box, src=src)  # the last stage's tokens, to every rank
            return box[0]

        return self.collective_rpc(step_and_share, non_block=non_block, unique_reply_rank=0)
