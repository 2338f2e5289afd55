"""Reader processes that report their own progress, so the ipc tests act on states, not sleeps
(importable by spawned children; ipc_children.py has the plain ones)."""

from __future__ import annotations

import threading
import time
from typing import Any

from sync_helpers import in_call

from shardserve.ipc import MessageQueueReader, QueueClosed, wakeup
from shardserve.ipc.zmq_channel import Subscriber

# Where a blocked dequeue sleeps: a remote reader in ZMQ's poll, a local one on a futex.
WAIT_CODES = (Subscriber.wait.__code__, wakeup.futex_wait.__code__)


def blocked_in_dequeue(thread: threading.Thread) -> bool:
    return any(in_call(thread, code) for code in WAIT_CODES)


def watched_echo_reader(handle: Any, rank: int, conn: Any) -> None:
    """Like ipc_children.echo_reader, and also sends ("blocked", n) once the reader waits in
    dequeue for its message n + 1 (a remote reader has no sleeping word in the ring to show)."""
    mq = MessageQueueReader.from_handle(handle, rank)
    mq.wait_until_ready(timeout=30)
    main = threading.current_thread()
    send_lock = threading.Lock()  # both threads send on conn
    got: list[Any] = []
    done = threading.Event()

    def send(msg: tuple) -> None:
        with send_lock:
            conn.send(msg)

    def watch() -> None:
        reported = -1
        while not done.wait(0.002):
            n = len(got)
            if n != reported and blocked_in_dequeue(main) and len(got) == n:
                send(("blocked", n))
                reported = n

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        while True:
            got.append(mq.dequeue(timeout=30))
            send(("got", got[-1]))
    except QueueClosed as e:
        send(("closed", time.monotonic(), repr(e)))
    finally:
        done.set()
        watcher.join(5)
        mq.close()


def acking_latency_reader(handle: Any, n: int, conn: Any) -> None:
    """Acknowledge each message (("got", i)) and report, at the end, each one's delay between
    the writer's send stamp and our receipt."""
    mq = MessageQueueReader.from_handle(handle, 0)
    mq.wait_until_ready(timeout=30)
    delays = []
    for i in range(n):
        sent = mq.dequeue(timeout=30)
        delays.append(time.time() - sent)
        conn.send(("got", i))
    conn.send(("delays", delays))
    mq.close()
