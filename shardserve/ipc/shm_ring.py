"""The shared-memory ring under MessageQueue: layout, space check, flag protocol.

One POSIX shared-memory file ``/dev/shm/shardserve-mq-<pid>-<random>`` per writer::

    offset 0            HEADER  (u64 words, padded to 64 B)
    +------------------------------------------------------------------------------+
    | magic | version | n_local | max_chunks | chunk_bytes | writer_pid | writer_start |
    | writer_closed | writer_sleeping | writer_copying | reader[0]: pid, start, closed,  |
    | sleeping | reader[1]: ... |
    +------------------------------------------------------------------------------+
    meta_off            CHUNK RECORDS  (u32 futex words, one 64 B-padded record per chunk)
    +------------------------------------------------------------------------------+
    | chunk 0: written | read[0] | read[1] | ... | read[n_local-1] | pad             |
    | chunk 1: written | read[0] | ...                                              |
    | ...                                                                           |
    +------------------------------------------------------------------------------+
    data_off (page aligned)   DATA  (max_chunks slots of chunk_bytes, 64 B aligned)
    +------------------+------------------+-----+---------------------------------+
    | chunk 0          | chunk 1          | ... | chunk max_chunks-1              |
    +------------------+------------------+-----+---------------------------------+

Messages are numbered n = 1, 2, 3, ... and message n lives in chunk (n - 1) % max_chunks.
The flags are generation counters (n mod 2**32) rather than booleans:

* ``written`` = number of the message the chunk holds (0: never written). Reader r expecting
  message n may read chunk c once ``written == n``. The writer stores it only after the payload,
  so a reader that sees it sees the payload (x86 TSO; a lock acquire/release fences elsewhere).
* ``read[r]`` = number of the last message in this chunk that local reader r released. The writer
  may overwrite chunk c with message n only when every ``read[r] == n - max_chunks`` (or
  n <= max_chunks): every local reader released the previous occupant.

Each word has exactly one writing process (``written``: the writer; ``read[r]``: reader r), so no
atomic read-modify-write is needed, the writer never has to reset reader flags (vLLM's ordering
hazard), and a skipped or repeated message is impossible: both sides walk n upwards. Sleepers
block on these very words with a futex (see wakeup.py); the header holds pids for liveness checks
and names in log messages.

Skipping needless wake-ups: a side about to sleep sets its ``sleeping`` word (writer_sleeping, or
its reader record's) and clears it after; a side that stores a flag calls FUTEX_WAKE only if the
other side's ``sleeping`` is set. That is the store-buffering pattern, safe only with a full fence
between "store flag" and "load sleeping" on both sides: the sleeper's is the futex syscall (the
kernel locks the futex bucket before comparing the word), the waker's is a locked instruction
(``full_fence``). Where ordering is weaker than x86's we always wake. Each message then costs one
syscall less per reader (a release nobody waits for), and none at all when nobody sleeps.

``writer_copying`` = number of the message the writer is copying in, stored when that copy is
big (a MiB or more: hundreds of microseconds). A reader polling for that message sleeps instead
(the publish wakes it): polling through the copy would only burn the cores the copy needs. A
hint only: a stale value names an older message and matches nothing.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import multiprocessing.util as mp_util
import os
import platform
import secrets
import threading
import weakref

from shardserve.ipc import wakeup
from shardserve.ipc.errors import ShmSpaceError

SHM_DIR = "/dev/shm"
NAME_PREFIX = "shardserve-mq-"
_MAGIC = 0x5348_4152_444D_5131  # "SHARDMQ1"
_VERSION = 3
_GEN_MASK = 0xFFFF_FFFF
_WEAK_ORDERING = platform.machine().lower() not in ("x86_64", "amd64", "i686", "i386")
# header word indices (u64)
_H_MAGIC, _H_VERSION, _H_N_LOCAL, _H_MAX_CHUNKS, _H_CHUNK_BYTES = 0, 1, 2, 3, 4
_H_WRITER_PID, _H_WRITER_START, _H_WRITER_CLOSED, _H_WRITER_SLEEPING = 5, 6, 7, 8
_H_WRITER_COPYING = 9  # number of a big message the writer is copying in (a hint, see below)
_H_READERS = 10  # then 4 words per local reader: pid, start, closed, sleeping
_R_PID, _R_START, _R_CLOSED, _R_SLEEPING = 0, 1, 2, 3


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def check_shm_space(nbytes: int, directory: str = SHM_DIR) -> None:
    """Fail now, with the fix, when ``directory`` cannot hold ``nbytes`` more."""
    try:
        st = os.statvfs(directory)
    except FileNotFoundError:
        return  # no such directory: nothing to check; opening the segment will say more
    free = st.f_bavail * st.f_frsize
    if free < nbytes:
        raise ShmSpaceError(_space_message(nbytes, free, directory))


def _space_message(nbytes: int, free: int | None, directory: str) -> str:
    have = "" if free is None else f" but only {free / 2**20:.1f} MiB are free"
    return (
        f"Insufficient space in {directory}: this MessageQueue ring needs "
        f"{nbytes / 2**20:.1f} MiB{have}. Give the container more shared memory "
        f"(docker run --shm-size=1g or --ipc=host; Kubernetes: an emptyDir with medium: Memory "
        f"mounted at /dev/shm), or lower max_chunk_bytes x max_chunks."
    )


class RingLayout:
    """Offsets of the regions for a given shape (shared by creator and attachers)."""

    def __init__(self, n_local: int, chunk_bytes: int, max_chunks: int) -> None:
        self.n_local, self.chunk_bytes, self.max_chunks = n_local, chunk_bytes, max_chunks
        self.header_bytes = _align(8 * (_H_READERS + 4 * n_local), 64)
        self.record_words = _align(4 * (1 + n_local), 64) // 4
        self.meta_off = self.header_bytes
        meta_end = self.meta_off + 4 * self.record_words * max_chunks
        self.data_off = _align(meta_end, mmap.PAGESIZE)
        self.stride = _align(chunk_bytes, 64)
        self.size = self.data_off + self.stride * max_chunks


class ShmRing:
    """Mapped ring segment; the creator (the queue's writer) owns and unlinks the file."""

    def __init__(self, layout: RingLayout, name: str, create: bool) -> None:
        self.layout, self.name, self.is_creator = layout, name, create
        self.path = os.path.join(SHM_DIR, name)
        self._mm = _create_file(self.path, layout.size) if create else _open_file(self.path)
        if len(self._mm) < layout.size:
            raise RuntimeError(f"{self.path} is {len(self._mm)} bytes, expected {layout.size}")
        # Pins the mapping and gives its address for futex(2); released in close().
        self._anchor = ctypes.c_char.from_buffer(self._mm)
        self._meta_addr = ctypes.addressof(self._anchor) + layout.meta_off
        whole = memoryview(self._mm)
        self._views = [whole]
        self.hdr = self._view(whole[: layout.header_bytes].cast("Q"))
        self.words = self._view(whole[layout.meta_off : layout.data_off].cast("I"))
        self.chunks = [
            self._view(whole[layout.data_off + i * layout.stride :][: layout.chunk_bytes])
            for i in range(layout.max_chunks)
        ]
        self._fence_lock = threading.Lock()
        self._sleeping_words = [_H_READERS + 4 * r + _R_SLEEPING for r in range(layout.n_local)]
        self._unlinked = not create
        self._finalizer = register_unlink(self, self.path) if create else None
        if create:
            self._init_header()
        else:
            self._check_header()

    def _view(self, mv: memoryview) -> memoryview:
        self._views.append(mv)
        return mv

    @classmethod
    def create(cls, n_local: int, chunk_bytes: int, max_chunks: int) -> ShmRing:
        name = f"{NAME_PREFIX}{os.getpid()}-{secrets.token_hex(6)}"
        return cls(RingLayout(n_local, chunk_bytes, max_chunks), name, create=True)

    def _init_header(self) -> None:
        lay, h = self.layout, self.hdr
        h[_H_N_LOCAL], h[_H_MAX_CHUNKS], h[_H_CHUNK_BYTES] = (
            lay.n_local, lay.max_chunks, lay.chunk_bytes)
        h[_H_WRITER_PID] = os.getpid()
        h[_H_WRITER_START] = wakeup.process_start_time(os.getpid())
        h[_H_VERSION] = _VERSION
        h[_H_MAGIC] = _MAGIC  # last: an attacher that sees the magic sees the rest

    def _check_header(self) -> None:
        lay, h = self.layout, self.hdr
        shape = (h[_H_N_LOCAL], h[_H_MAX_CHUNKS], h[_H_CHUNK_BYTES])
        if h[_H_MAGIC] != _MAGIC or shape != (lay.n_local, lay.max_chunks, lay.chunk_bytes):
            raise RuntimeError(f"{self.path} is not a shardserve ring of the expected shape")

    # ---- word addressing -----------------------------------------------------------------
    def written_index(self, chunk: int) -> int:
        return chunk * self.layout.record_words

    def read_index(self, chunk: int, reader: int) -> int:
        return chunk * self.layout.record_words + 1 + reader

    def addr(self, word_index: int) -> int:
        return self._meta_addr + 4 * word_index

    def fence(self) -> None:
        """Order our payload accesses before a flag store.

        x86 (TSO) never reorders a store with earlier loads or stores, and the payload copy is
        an opaque C call the compiler cannot move, so nothing is needed there. Elsewhere a lock
        round trip gives acquire/release ordering.
        """
        if _WEAK_ORDERING:
            with self._fence_lock:
                pass

    # ---- flag protocol ---------------------------------------------------------------------
    def chunk_of(self, n: int) -> int:
        return (n - 1) % self.layout.max_chunks

    def blocker(self, n: int) -> int:
        """First local reader still holding the chunk that message ``n`` needs, or -1."""
        if n <= self.layout.max_chunks:
            return -1
        prev = (n - self.layout.max_chunks) & _GEN_MASK
        base = self.read_index(self.chunk_of(n), 0)
        words = self.words
        for r in range(self.layout.n_local):
            if words[base + r] != prev:
                return r
        return -1

    def publish(self, n: int, notify: bool) -> None:
        """Mark message ``n`` written (after its payload) and wake readers sleeping on it."""
        idx = self.written_index(self.chunk_of(n))
        self.fence()  # payload stores before the flag store
        self.words[idx] = n & _GEN_MASK
        if notify and self._any_reader_sleeping():
            wakeup.futex_wake(self.addr(idx))

    def _any_reader_sleeping(self) -> bool:
        if _WEAK_ORDERING:
            return True
        self.full_fence()  # our flag store is visible before we look (see the module docstring)
        h = self.hdr
        return any(h[base] for base in self._sleeping_words)

    def is_written(self, n: int) -> bool:
        return self.words[self.written_index(self.chunk_of(n))] == n & _GEN_MASK

    def release(self, n: int, reader: int) -> None:
        """Reader ``reader`` is done with message ``n``: the writer may reuse its chunk."""
        idx = self.read_index(self.chunk_of(n), reader)
        self.fence()  # our loads of the payload complete before the writer may overwrite it
        self.words[idx] = n & _GEN_MASK
        if _WEAK_ORDERING:
            wakeup.futex_wake(self.addr(idx))
            return
        self.full_fence()
        if self.hdr[_H_WRITER_SLEEPING]:
            wakeup.futex_wake(self.addr(idx))

    def mark_copying(self, n: int) -> None:
        self.hdr[_H_WRITER_COPYING] = n & _GEN_MASK

    def writer_copying(self, n: int) -> bool:
        return self.hdr[_H_WRITER_COPYING] == n & _GEN_MASK

    def set_sleeping(self, reader: int | None, sleeping: bool) -> None:
        """Announce that the writer (reader None) or a reader is about to sleep, or woke up."""
        word = _H_WRITER_SLEEPING if reader is None else _H_READERS + 4 * reader + _R_SLEEPING
        self.hdr[word] = int(sleeping)

    def is_sleeping(self, reader: int | None) -> bool:
        """Read-only: whether the writer (reader None) or a reader announced a sleep."""
        word = _H_WRITER_SLEEPING if reader is None else _H_READERS + 4 * reader + _R_SLEEPING
        return bool(self.hdr[word])

    def full_fence(self) -> None:
        """A full memory barrier: acquiring a lock executes a locked (serialising) instruction."""
        with self._fence_lock:
            pass

    # ---- participants ----------------------------------------------------------------------
    def register_reader(self, reader: int) -> None:
        base = _H_READERS + 4 * reader
        self.hdr[base + _R_START] = wakeup.process_start_time(os.getpid())
        self.hdr[base + _R_CLOSED] = 0
        self.hdr[base + _R_PID] = os.getpid()

    def reader_info(self, reader: int) -> tuple[int, int, bool]:
        base = _H_READERS + 4 * reader
        h = self.hdr
        return h[base + _R_PID], h[base + _R_START], bool(h[base + _R_CLOSED])

    def writer_info(self) -> tuple[int, int, bool]:
        h = self.hdr
        return h[_H_WRITER_PID], h[_H_WRITER_START], bool(h[_H_WRITER_CLOSED])

    def mark_reader_closed(self, reader: int) -> None:
        self.hdr[_H_READERS + 4 * reader + _R_CLOSED] = 1
        for c in range(self.layout.max_chunks):  # a writer may sleep on any of our words
            wakeup.futex_wake(self.addr(self.read_index(c, reader)))

    def mark_writer_closed(self) -> None:
        self.hdr[_H_WRITER_CLOSED] = 1
        self.wake_readers()

    def wake_readers(self) -> None:
        for c in range(self.layout.max_chunks):
            wakeup.futex_wake(self.addr(self.written_index(c)))

    # ---- lifetime --------------------------------------------------------------------------
    def unlink(self) -> None:
        """Remove the name; mappings stay valid. Idempotent; only the creator unlinks."""
        if self.is_creator and not self._unlinked:
            self._unlinked = True
            _unlink_quiet(self.path)
            if self._finalizer is not None:
                self._finalizer.detach()

    def close(self) -> None:
        self.unlink()
        for mv in reversed(self._views):
            mv.release()
        self._views.clear()
        del self._anchor
        self._mm.close()


def register_unlink(owner: object, path: str, remove_parent: bool = False) -> weakref.finalize:
    """Unlink ``path`` (and with remove_parent its folder, once empty) when ``owner`` is
    collected or the interpreter exits.

    multiprocessing children leave through os._exit (no atexit), so their exit hook is used too.
    Calling the returned finalizer unlinks at once; detaching it cancels the GC/atexit unlink.
    """
    mp_util.Finalize(owner, _unlink_quiet, args=(path, remove_parent), exitpriority=0)
    return weakref.finalize(owner, _unlink_quiet, path, remove_parent)


def _unlink_quiet(path: str, remove_parent: bool = False) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    if remove_parent:
        try:
            os.rmdir(os.path.dirname(path))
        except OSError:  # gone already, or not empty
            pass


def _create_file(path: str, size: int) -> mmap.mmap:
    check_shm_space(size, os.path.dirname(path))
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, size)
        _reserve(fd, size, path)
        return _map(fd, size)
    except BaseException:
        _unlink_quiet(path)
        raise
    finally:
        os.close(fd)


def _reserve(fd: int, size: int, path: str) -> None:
    """Allocate the pages now: tmpfs allocates lazily and a later shortage is a SIGBUS."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise ShmSpaceError(_space_message(size, None, os.path.dirname(path))) from e
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise


def _open_file(path: str) -> mmap.mmap:
    # Opened directly rather than via multiprocessing.shared_memory, so the resource tracker
    # never learns about it and never "cleans up" (or warns about) a segment we do not own.
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError as e:
        raise FileNotFoundError(
            f"{path} does not exist: the writer closed, or every local reader already attached "
            f"(the writer unlinks the name once they all have), or this reader is on another host"
        ) from e
    try:
        return _map(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)


def _map(fd: int, size: int) -> mmap.mmap:
    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)  # fault pages in up front
    return mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
