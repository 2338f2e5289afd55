"""Bodies of the processes the ipc tests spawn (importable by spawned children)."""

from __future__ import annotations

import os
import random
import time
from typing import Any

import numpy as np

from shardserve.ipc import MessageQueueReader, MessageQueueWriter, QueueClosed

N_MESSAGES = 10_000
MAX_LEN = 10_000  # int64 elements: up to 80 KB, about 40 KB on average (~400 MB in total)


def arrays(seed: int) -> Any:
    """The message stream every side regenerates (sizes and contents from one seed)."""
    rng = np.random.default_rng(seed)
    for i in range(N_MESSAGES):
        yield i, rng.integers(-(2**62), 2**62, size=int(rng.integers(1, MAX_LEN + 1)))


def jitter(rng: random.Random) -> None:
    if rng.random() < 0.05:  # ~500 sleeps of 0-2 ms on every side
        time.sleep(rng.random() * 0.002)


def broadcast_reader(handle: Any, rank: int, seed: int, conn: Any) -> None:
    """Receive the whole stream, compare every array bit-exactly, report (count, bytes, error)."""
    mq = MessageQueueReader.from_handle(handle, rank, name=f"stress-{rank}")
    mq.wait_until_ready(timeout=30)
    rng, count, nbytes, error = random.Random(rank), 0, 0, None
    for i, want in arrays(seed):
        got = mq.dequeue(timeout=60)
        if got[0] != i or got[1].dtype != want.dtype or not np.array_equal(got[1], want):
            error = f"rank {rank}: message {i} differs (got index {got[0]})"
            break
        count, nbytes = count + 1, nbytes + got[1].nbytes
        jitter(rng)
    conn.send((count, nbytes, error))
    mq.close()


def echo_reader(handle: Any, rank: int, conn: Any) -> None:
    """Read until QueueClosed; report what was read and how long the last wait took."""
    mq = MessageQueueReader.from_handle(handle, rank)
    mq.wait_until_ready(timeout=30)
    got = []
    try:
        while True:
            got.append(mq.dequeue(timeout=30))
            conn.send(("got", got[-1]))
    except QueueClosed as e:
        conn.send(("closed", time.monotonic(), repr(e)))
    finally:
        mq.close()


def latency_reader(handle: Any, n: int, conn: Any) -> None:
    """Report, per message, the delay between the writer's send stamp and our receipt."""
    mq = MessageQueueReader.from_handle(handle, 0)
    mq.wait_until_ready(timeout=30)
    delays = []
    for _ in range(n):
        sent = mq.dequeue(timeout=30)
        delays.append(time.time() - sent)
    conn.send(delays)
    mq.close()


def writer_then_hang(conn: Any) -> None:
    """A writer that hands out its handle, sends one message and then blocks (to be killed)."""
    mq = MessageQueueWriter(1, 1, max_chunk_bytes=1 << 16, max_chunks=2, name="doomed")
    conn.send(mq.export_handle())
    mq.wait_until_ready(timeout=30)
    mq.enqueue("first")
    conn.send(os.getpid())
    time.sleep(120)


def leaky_writer(conn: Any) -> None:
    """Creates a writer and exits without closing it: the exit handler must unlink it."""
    mq = MessageQueueWriter(2, 2, max_chunk_bytes=1 << 16, max_chunks=2, name="leaky")
    conn.send(mq.export_handle().shm_name)


def remote_writer_then_hang(conn: Any) -> None:
    """writer_then_hang with one remote (TCP) reader and no local one."""
    mq = MessageQueueWriter(1, 0, name="doomed-remote", connect_ip="127.0.0.1")
    conn.send(mq.export_handle())
    mq.wait_until_ready(timeout=30)
    mq.enqueue("first")
    conn.send(os.getpid())
    time.sleep(120)
