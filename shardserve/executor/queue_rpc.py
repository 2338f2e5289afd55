"""QueueRpc: the shared-memory RPC plumbing of every backend whose workers run
`worker_main.run_busy_loop` (mp, ray_v2): one broadcast MessageQueue out, one reply queue per
rank back, an RpcChannel over them, and their orderly shutdown.

    executor ─ call() ─▶ RpcChannel ─RpcRequest─▶ broadcast (1 → world_size) ─▶ rank busy loops
                                   ◀─RpcReply─── reply_queues[rank] ◀───────────────────┘

The executors own the processes (how workers start, how a death is noticed); this object owns
the queues. Shutdown order, shared by both: ask the workers to exit (`ask_workers_to_exit`),
let the executor stop the processes, then `close` (queues closed, segments of dead workers
unlinked, pending calls failed).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from shardserve.errors import EngineDeadError, WorkerStartupError
from shardserve.executor.rpc_channel import RpcChannel, WorkerHooks
from shardserve.ipc import Handle, MessageQueue, MessageQueueReader, MessageQueueWriter
from shardserve.ipc.rpc import SHUTDOWN, RpcRequest
from shardserve.ipc.segments import unlink_segment

logger = logging.getLogger(__name__)


class QueueRpc:
    def __init__(self, broadcast: MessageQueueWriter) -> None:
        self.broadcast = broadcast
        self.reply_handles: list[Handle] = []
        self.reply_queues: list[MessageQueueReader] = []
        self.channel: RpcChannel | None = None

    def connect(self, reply_handles: list[Handle], hooks: WorkerHooks, timeout_s: float,
                abort: Callable[[], str | None] = lambda: None) -> None:
        """Attach to every rank's reply queue, then wait for both handshakes. `abort` names a
        failure that makes waiting pointless (a lost node): checked twice a second.

        Ordering: attach to the reply queues before waiting on the broadcast queue; each worker
        waits for the broadcast handshake before it waits for our attachment.
        """
        self.reply_handles = list(reply_handles)
        self.reply_queues = [
            MessageQueueReader.from_handle(h, 0, name=f"replies-from-TP{rank}")
            for rank, h in enumerate(self.reply_handles)
        ]
        deadline = time.monotonic() + timeout_s
        for mq in [self.broadcast, *self.reply_queues]:
            _wait_ready(mq, deadline, abort)
        self.channel = RpcChannel(self.broadcast, self.reply_queues, hooks)

    def call(
        self,
        method: str | Callable[..., Any],
        timeout: float | None = None,
        args: tuple = (),
        kwargs: dict[str, Any] | None = None,
        non_block: bool = False,
        unique_reply_rank: int | None = None,
    ) -> Any:
        """collective_rpc over the queues (see Executor.collective_rpc)."""
        if self.channel is None:
            raise EngineDeadError("the workers are not connected (start-up failed or shut down)")
        return self.channel.call(method, timeout, args, kwargs, non_block, unique_reply_rank)

    def ask_workers_to_exit(self) -> bool:
        """Broadcast the shutdown request; False if it could not be sent (a stuck worker's full
        ring, or a closed queue): the caller then stops the processes by signal at once."""
        try:
            self.broadcast.enqueue(RpcRequest(0, SHUTDOWN, (), {}), timeout=1.0)
            return True
        except Exception as e:
            logger.warning("could not ask the workers to exit (%s); stopping them", e)
            return False

    def close(self) -> None:
        """After the workers are stopped: close every queue, unlink the reply rings (a killed
        worker could not), and fail the calls still pending."""
        for mq in [*self.reply_queues, self.broadcast]:
            mq.close()
        for h in self.reply_handles:
            unlink_segment(h.shm_name)
        if self.channel is not None:
            self.channel.fail_pending(EngineDeadError("the executor was shut down"))


def _wait_ready(mq: MessageQueue, deadline: float, abort: Callable[[], str | None]) -> None:
    while True:
        if (why := abort()) is not None:
            raise WorkerStartupError(why)
        try:
            mq.wait_until_ready(timeout=max(0.0, min(0.5, deadline - time.monotonic())))
            return
        except TimeoutError:
            if time.monotonic() >= deadline:
                raise
