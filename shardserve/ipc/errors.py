"""Exceptions raised by shardserve.ipc."""

from __future__ import annotations


class QueueClosed(EOFError):
    """The queue was closed: by this process (possibly from another thread) or by the other side.

    An ``EOFError`` because it means "no more messages will ever come through here", like
    ``Connection.recv`` on a closed pipe.
    """


class PeerGone(QueueClosed, TimeoutError):
    """The process on the other side died or closed while we waited for it.

    It is both a ``QueueClosed`` (nothing will ever arrive) and a ``TimeoutError`` (the wait
    could not complete in any amount of time), so callers catching either see it. The message
    names the peer (rank and pid).
    """


class ShmSpaceError(RuntimeError):
    """``/dev/shm`` cannot hold the ring; raised at construction instead of a SIGBUS later."""
