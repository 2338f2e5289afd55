"""Inter-process messaging: the shared-memory broadcast queue's writer and reader ends."""

from shardserve.ipc.errors import PeerGone, QueueClosed, ShmSpaceError
from shardserve.ipc.message_queue import Handle, MessageQueue
from shardserve.ipc.message_queue_reader import MessageQueueReader
from shardserve.ipc.message_queue_writer import MessageQueueWriter

__all__ = ["Handle", "MessageQueue", "MessageQueueReader", "MessageQueueWriter", "PeerGone",
           "QueueClosed", "ShmSpaceError"]
