"""The simplest broadcast queue that could beat ours: a floor prototype, not a product.

Data in a shared-memory ring; one process-shared POSIX semaphore per local reader, posted once
per message (glibc's sem_post makes a syscall only when the reader sleeps); readers copy the
payload out (the unpickler's own copy). By default no spinning (the issue's prototype);
MQPROTO_YIELD_US=100 polls with sched_yield for up to that long before sem_wait, as
MessageQueue does (a floor for that design). No liveness checks, no close protocol, no remote
readers, no overflow, no warnings: everything MessageQueue guarantees beyond moving bytes is
left out, so the gap between the two is what those guarantees (and our code) cost. vLLM's
method names, so ../shared/bench/mq_peer_bench.py can run it beside the real queues:

    PYTHONPATH=$PWD .venv/bin/python ../shared/bench/mq_peer_bench.py \
        --impl bench._mq_sem_prototype --impl bench.mq_vllm_api

Layout: [sem_t x n_reader (64 B each)] [u64 written[max_chunks]] [u64 read[max_chunks][n]]
        [chunks: u64 length, pickle bytes]
"""

from __future__ import annotations

import ctypes
import mmap
import os
import pickle
import secrets
import struct
import time

_libc = ctypes.CDLL(None, use_errno=True)
_sem_init, _sem_post, _sem_wait, _sem_trywait = (
    _libc.sem_init, _libc.sem_post, _libc.sem_wait, _libc.sem_trywait)
for _f in (_sem_post, _sem_wait, _sem_trywait):
    _f.argtypes = [ctypes.c_void_p]
_sem_init.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint]
_LEN = struct.Struct("<Q")
_SEM = 64
_YIELD_S = float(os.environ.get("MQPROTO_YIELD_US", "0")) * 1e-6  # poll with sched_yield first


class MessageQueue:
    def __init__(self, n_reader: int, n_local_reader: int | None = None,
                 max_chunk_bytes: int = 1 << 24, max_chunks: int = 10, **_ignored) -> None:
        self.n, self.chunks, self.chunk_bytes = n_reader, max_chunks, max_chunk_bytes
        self.name = f"/dev/shm/mqproto-{os.getpid()}-{secrets.token_hex(4)}"
        fd = os.open(self.name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.ftruncate(fd, self._size())
        self._map(fd)
        for r in range(n_reader):
            _sem_init(self._base + r * _SEM, 1, 0)
        self.rank, self.next = None, 1

    def _size(self) -> int:
        self.meta = _SEM * self.n
        self.data = (self.meta + 8 * self.chunks * (1 + self.n) + 4095) // 4096 * 4096
        return self.data + self.chunk_bytes * self.chunks

    def _map(self, fd: int) -> None:
        self.mm = mmap.mmap(fd, self._size())
        os.close(fd)
        self._anchor = ctypes.c_char.from_buffer(self.mm)
        self._base = ctypes.addressof(self._anchor)
        self.words = memoryview(self.mm)[self.meta:self.data].cast("Q")
        self.buf = memoryview(self.mm)[self.data:]

    def export_handle(self) -> tuple:
        return self.name, self.n, self.chunks, self.chunk_bytes

    @classmethod
    def create_from_handle(cls, handle: tuple, rank: int) -> MessageQueue:
        self = cls.__new__(cls)
        self.name, self.n, self.chunks, self.chunk_bytes = handle
        self._map(os.open(self.name, os.O_RDWR))
        self.rank, self.next = rank, 1
        return self

    def wait_until_ready(self, timeout: float | None = None) -> None:
        pass

    def enqueue(self, obj, timeout: float | None = None) -> None:
        n, c = self.next, (self.next - 1) % self.chunks
        prev = n - self.chunks
        rd = self.chunks + c * self.n
        while prev > 0 and any(self.words[rd + r] != prev for r in range(self.n)):
            time.sleep(0)  # ring full: the prototype never meets this in the harness
        data = pickle.dumps(obj, protocol=5)
        off = c * self.chunk_bytes
        _LEN.pack_into(self.buf, off, len(data))
        self.buf[off + 8:off + 8 + len(data)] = data
        self.words[c] = n
        for r in range(self.n):
            _sem_post(self._base + r * _SEM)
        self.next = n + 1

    def dequeue(self, timeout: float | None = None):
        sem = self._base + self.rank * _SEM
        if _sem_trywait(sem) != 0:
            end = time.perf_counter() + _YIELD_S
            while True:
                if time.perf_counter() >= end:
                    _sem_wait(sem)
                    break
                os.sched_yield()
                if _sem_trywait(sem) == 0:
                    break
        n, c = self.next, (self.next - 1) % self.chunks
        off = c * self.chunk_bytes
        (length,) = _LEN.unpack_from(self.buf, off)
        obj = pickle.loads(self.buf[off + 8:off + 8 + length])  # the unpickler copies
        self.words[self.chunks + c * self.n + self.rank] = n
        self.next = n + 1
        return obj

    def close(self) -> None:
        if self.rank is None:
            try:
                os.unlink(self.name)
            except FileNotFoundError:
                pass
