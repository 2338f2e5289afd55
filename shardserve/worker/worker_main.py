"""The entry point and busy loop of one worker process (mp backend; ray_v2 reuses the loop).

Start-up, in order (the executor's side is in executor/worker_process.py):
  1. watch the death pipe: EOF means the engine process is gone, even by SIGKILL → exit at once;
  2. build the Worker, init_device (joins the TP process group), load_model;
  3. create this rank's response queue and report READY with its handle (or FAILED with the
     error) over the ready pipe;
  4. attach to the broadcast queue, then wait for the executor to attach to the response queue.
     Steps 3-4 must stay in this order: the executor attaches to response queues only after
     READY, and waits for every rank to attach to the broadcast queue after that.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from shardserve.config import EngineConfig
from shardserve.errors import RemoteError
from shardserve.ipc import Handle, MessageQueue, MessageQueueReader, MessageQueueWriter, QueueClosed
from shardserve.ipc.rpc import SHUTDOWN, RpcReply, RpcRequest
from shardserve.ipc.segments import unlink_segment
from shardserve.process_setup import run_on_fresh_thread, setup_process
from shardserve.worker.build import build_worker
from shardserve.worker.worker import run_method

logger = logging.getLogger(__name__)

ATTACH_TIMEOUT_S = 60.0


@dataclass
class WorkerProcArgs:
    """Everything a worker process is started with (pickled by the spawn start method)."""

    config: EngineConfig
    rank: int
    local_rank: int
    local_world_size: int
    distributed_init_method: str
    broadcast_handle: Handle
    ready_conn: Connection
    death_conn: Connection
    # Forked children: the parent's ends of earlier ranks' pipes, inherited by fork; closed first.
    close_fds: tuple[int, ...] = ()
    forked: bool = False
    # Set on a node other than the engine's: the reply queue is a TCP publisher bound here.
    reply_ip: str | None = None

    @property
    def label(self) -> str:
        return f"Worker_TP{self.rank}"


def worker_main(args: WorkerProcArgs) -> None:
    """Process target. Exits 0 after a shutdown request, non-zero after a failure."""
    for fd in args.close_fds:
        try:
            os.close(fd)
        except OSError:
            pass
    setup_process(f"shardserve::{args.label}",
                  f"({args.label} pid={os.getpid()}) %(levelname)s %(name)s: %(message)s")
    if args.forked:
        run_on_fresh_thread(lambda: _serve(args), f"{args.label}-main")
    else:
        _serve(args)


def _serve(args: WorkerProcArgs) -> None:
    # Segments nobody else can unlink if the engine dies by SIGKILL: its broadcast ring (when we
    # share its machine: a remote reader reads over TCP, and the name is not ours to unlink), ours.
    local = args.rank < args.broadcast_handle.n_local_reader
    orphans = [args.broadcast_handle.shm_name if local else None]
    _watch_death_pipe(args.death_conn, orphans)
    worker = response_mq = broadcast = None
    try:
        try:
            worker = build_worker(args.config, args.rank, args.local_rank,
                                  args.distributed_init_method, args.local_world_size)
            response_mq = MessageQueueWriter(1, 0 if args.reply_ip else 1,
                                             connect_ip=args.reply_ip, name=f"{args.label}-reply")
            orphans.append(response_mq.export_handle().shm_name)
        except BaseException as e:
            args.ready_conn.send(("FAILED", RemoteError.capture(args.rank, os.getpid(), e)))
            raise SystemExit(1) from e
        args.ready_conn.send(("READY", response_mq.export_handle()))
        broadcast = MessageQueueReader.from_handle(
            args.broadcast_handle, args.rank, name=f"{args.label}-bcast"
        )
        broadcast.wait_until_ready(timeout=ATTACH_TIMEOUT_S)
        response_mq.wait_until_ready(timeout=ATTACH_TIMEOUT_S)
        run_busy_loop(worker, args.rank, broadcast, response_mq)
    finally:
        _close_all(worker, broadcast, response_mq)


def _watch_death_pipe(conn: Connection, orphans: list[str | None]) -> None:
    def watch() -> None:
        try:
            conn.recv()  # the engine never writes; this returns only by EOF
        except (EOFError, OSError):
            pass
        logger.error("the engine process is gone; exiting")
        for name in orphans:
            unlink_segment(name)
        os._exit(1)

    threading.Thread(target=watch, name="death-pipe", daemon=True).start()


def run_busy_loop(worker: Any, rank: int, broadcast: MessageQueueReader,
                  replies: MessageQueueWriter) -> None:
    """Serve RpcRequests until a shutdown request or the broadcast queue closes.

    Replies are sent by a separate thread, so the next request is read (and the next step
    started) while the last reply is still being serialised.
    """
    outbox: queue.SimpleQueue[RpcReply | None] = queue.SimpleQueue()
    sender = threading.Thread(target=_send_replies, args=(outbox, replies, rank), daemon=True)
    sender.start()
    pid = os.getpid()
    try:
        while True:
            try:
                request: RpcRequest = broadcast.dequeue()
            except QueueClosed:
                return
            if request.method == SHUTDOWN:
                return
            try:
                value = run_method(worker, request.decode_method(), request.args, request.kwargs)
            except Exception as e:
                outbox.put(RpcReply(request.call_id, rank, error=RemoteError.capture(rank, pid, e)))
                continue
            if request.reply_rank is None or request.reply_rank == rank:
                outbox.put(RpcReply(request.call_id, rank, value))
    finally:
        outbox.put(None)
        sender.join(timeout=5)


def _send_replies(outbox: queue.SimpleQueue, replies: MessageQueueWriter, rank: int) -> None:
    while (reply := outbox.get()) is not None:
        try:
            replies.enqueue(reply)
        except QueueClosed:
            return
        except Exception as e:  # e.g. a result that does not pickle: report it, don't go silent
            error = RemoteError.capture(rank, os.getpid(), e)
            replies.enqueue(RpcReply(reply.call_id, rank, error=error))


def _close_all(worker: Any, *queues: MessageQueue | None) -> None:
    if worker is not None:
        try:
            worker.shutdown()
        except Exception:
            logger.exception("worker shutdown failed")
    for mq in queues:
        if mq is not None:
            mq.close()
