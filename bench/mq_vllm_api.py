"""shardserve's broadcast queue behind vLLM's names, for ../shared/bench/mq_peer_bench.py.

That harness (like vLLM's ``shm_broadcast``) makes the writer with
``MessageQueue(n_reader, n_local_reader, ...)`` and a reader with
``MessageQueue.create_from_handle(handle, rank)``; shardserve has a type per end
(``MessageQueueWriter``, ``MessageQueueReader``), so this module maps the one onto the other:

    PYTHONPATH=$PWD .venv/bin/python ../shared/bench/mq_peer_bench.py \
        --impl bench.mq_vllm_api --impl pipe
"""

from __future__ import annotations

from typing import Any

from shardserve.ipc import Handle, MessageQueueReader, MessageQueueWriter


class MessageQueue:
    """Only constructors: calling the class makes the writer, ``create_from_handle`` a reader."""

    def __new__(cls, n_reader: int, n_local_reader: int, **options: Any) -> MessageQueueWriter:
        return MessageQueueWriter(n_reader, n_local_reader, **options)

    @staticmethod
    def create_from_handle(handle: Handle, rank: int, **options: Any) -> MessageQueueReader:
        return MessageQueueReader.from_handle(handle, rank, **options)
