"""Inter-process messaging: the shared-memory broadcast MessageQueue."""

from shardserve.ipc.errors import PeerGone, QueueClosed, ShmSpaceError
from shardserve.ipc.message_queue import Handle, MessageQueue

__all__ = ["Handle", "MessageQueue", "PeerGone", "QueueClosed", "ShmSpaceError"]
