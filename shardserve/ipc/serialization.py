"""Pickle protocol 5 with out-of-band buffers, written straight into a ring chunk.

The writer's pickler writes into the chunk itself (``Encoder.encode_into``): the pickle stream
costs one copy (the object's bytes into shared memory), not two (into a BytesIO, then into the
chunk). Big buffers (numpy arrays, CPU torch tensors of ``oob_threshold`` bytes or more) are not
copied into the pickle stream: the pickler hands them over as raw memoryviews and the writer
copies each one after the stream. The reader unpickles from the chunk in place (the unpickler
copies what it builds) and copies each out-of-band buffer into a fresh, writable ``bytearray``
(unavoidable: the chunk is reused ``max_chunks`` messages later, so a received array must not
alias it); the array is built on top of that bytearray.

Frame inside a chunk (little endian)::

    0        4        8          16     64                 align64(64 + main_len)
    +--------+--------+----------+------+------------------+-----------------+----------+-----+
    | kind   | nbuf   | main_len | pad  | pickle stream    | u64 len[nbuf]   | buffer 0 | ... |
    +--------+--------+----------+------+------------------+-----------------+----------+-----+

``nbuf`` counts the out-of-band buffers (the length table and the buffers are absent when it is
0); each buffer starts 64-byte aligned. ``kind`` is INLINE (the message is in this chunk) or
OVERFLOW (the chunk is only a marker; the message follows on the ZMQ socket in the same order,
as the frames [pickle stream, buffer 0, ...]).
"""

from __future__ import annotations

import copyreg
import io
import pickle
import struct
import sys
from collections.abc import Callable, Mapping
from typing import Any

INLINE = 1
OVERFLOW = 2
_HDR = struct.Struct("<IIQ")
_MAIN_OFF = 64
_LEN_STRUCTS: dict[int, struct.Struct] = {}
_table_cache: dict[tuple[int, int], dict[Any, Any]] = {}


def _align(n: int) -> int:
    return (n + 63) & ~63


def _lens_struct(nbuf: int) -> struct.Struct:
    s = _LEN_STRUCTS.get(nbuf)
    if s is None:
        s = _LEN_STRUCTS[nbuf] = struct.Struct(f"<{nbuf}Q")
    return s


class Encoded:
    """A pickled message as ZMQ frames: the pickle stream plus its out-of-band buffers."""

    __slots__ = ("main", "oob")

    def __init__(self, main: memoryview, oob: list[memoryview]) -> None:
        self.main, self.oob = main, oob

    def frames(self) -> list[memoryview]:
        """[pickle stream, *out-of-band buffers], for a ZMQ multipart message."""
        return [self.main, *self.oob]


BIG_COPY = 1 << 20  # a copy this size takes hundreds of microseconds: worth announcing


class _ChunkFile:
    """The pickler's file: appends into a chunk; spills into a BytesIO once the chunk is full.
    ``on_big`` is called (once) before the first big copy into the chunk."""

    __slots__ = ("dst", "pos", "limit", "spill", "on_big")

    def reset(self, dst: memoryview | None, on_big: Callable[[], None] | None) -> None:
        self.dst, self.pos, self.on_big = dst, _MAIN_OFF, on_big
        self.limit = 0 if dst is None else dst.nbytes
        self.spill: io.BytesIO | None = None if dst is not None else io.BytesIO()

    def announce(self, nbytes: int) -> None:
        if nbytes >= BIG_COPY and self.on_big is not None:
            self.on_big()
            self.on_big = None

    def write(self, b: Any) -> int:
        if type(b) is not bytes:
            b = memoryview(b)
            if b.format != "B" or b.ndim != 1:
                b = b.cast("B")
        n = len(b)
        if self.spill is None:
            end = self.pos + n
            if end <= self.limit:
                self.announce(n)
                self.dst[self.pos : end] = b
                self.pos = end
                return n
            self.spill = io.BytesIO()
            self.spill.write(self.dst[_MAIN_OFF : self.pos])
        return self.spill.write(b)


class Encoder:
    """One writer's reusable pickler (building one per message costs more than the pickling).

    Not thread-safe: the queue calls it under its operation lock.
    """

    def __init__(self, oob_threshold: int) -> None:
        self.oob_threshold = oob_threshold
        self._file = _ChunkFile()
        self._oob: list[memoryview] = []
        self._pickler: pickle.Pickler | None = None
        self._table_key: tuple[int, bool] = (-1, False)

    def _keep_in_band(self, buf: pickle.PickleBuffer) -> bool:
        try:
            raw = buf.raw()
        except BufferError:  # not contiguous: let pickle copy it in-band
            return True
        if raw.nbytes < self.oob_threshold:
            return True
        self._oob.append(raw)
        return False

    def _plain_pickler(self) -> pickle.Pickler:
        key = (len(copyreg.dispatch_table), "torch" in sys.modules)
        if self._pickler is None or key != self._table_key:
            self._pickler = _pickler(self._file, self._keep_in_band, pickle.Pickler)
            self._table_key = key
        self._pickler.clear_memo()
        return self._pickler

    def encode_into(self, obj: Any, dst: memoryview | None,
                    on_big: Callable[[], None] | None = None) -> Encoded | None:
        """Pickle ``obj`` into ``dst`` as an INLINE frame and return None; or, when it does not
        fit (or ``dst`` is None), return its ZMQ frames and leave ``dst``'s frame unwritten.
        ``on_big`` is called before a big copy into ``dst`` starts."""
        f, oob = self._file, self._oob
        try:
            f.reset(dst, on_big)
            oob.clear()
            self._plain_pickler().dump(obj)
        except (pickle.PicklingError, AttributeError, TypeError):
            # Lambdas, local classes and the like: cloudpickle handles them and its output
            # loads with the plain unpickler.
            import cloudpickle

            self._pickler = None  # a failed dump may leave state behind: build a fresh one
            f.reset(dst, on_big)
            oob.clear()
            _pickler(f, self._keep_in_band, cloudpickle.Pickler).dump(obj)
        main_len = f.pos - _MAIN_OFF if f.spill is None else f.spill.tell()
        if f.spill is None and self._place_oob(dst, main_len, f):
            return None
        main = f.spill.getbuffer() if f.spill is not None else memoryview(
            bytes(dst[_MAIN_OFF : f.pos]))
        return Encoded(main, list(oob))

    def _place_oob(self, dst: memoryview, main_len: int, f: _ChunkFile) -> bool:
        """Append the out-of-band buffers after the stream and write the header; False when
        they do not fit."""
        oob, nbuf = self._oob, len(self._oob)
        off = _align(_MAIN_OFF + main_len)
        if nbuf:
            table, off = off, off + _align(8 * nbuf)
            total = sum(_align(b.nbytes) for b in oob)
            if off + total > dst.nbytes:
                return False
            f.announce(total)
            _lens_struct(nbuf).pack_into(dst, table, *(b.nbytes for b in oob))
            for b in oob:
                n = b.nbytes
                dst[off : off + n] = b.cast("B") if b.format != "B" or b.ndim != 1 else b
                off += _align(n)
        _HDR.pack_into(dst, 0, INLINE, nbuf, main_len)
        return True


def inline_frames(src: memoryview) -> list[memoryview]:
    """The ZMQ frames of an INLINE frame, as views of ``src`` (for remote readers)."""
    _, nbuf, main_len = _HDR.unpack_from(src, 0)
    frames = [src[_MAIN_OFF : _MAIN_OFF + main_len]]
    if nbuf:
        off = _align(_MAIN_OFF + main_len)
        lens = _lens_struct(nbuf).unpack_from(src, off)
        off += _align(8 * nbuf)
        for n in lens:
            frames.append(src[off : off + n])
            off += _align(n)
    return frames


def _pickler(f: Any, callback: Any, cls: type) -> pickle.Pickler:
    p = cls(f, protocol=5, buffer_callback=callback)
    base = getattr(cls, "dispatch_table", None)  # the C Pickler has a descriptor here
    if not isinstance(base, Mapping):
        base = copyreg.dispatch_table
    p.dispatch_table = _dispatch_table(base)
    return p


def _dispatch_table(base: Any) -> Any:
    """The pickler's table plus our tensor reducer once torch is loaded (never imports torch)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return base
    key = (id(base), len(base))  # len: notice later copyreg registrations
    table = _table_cache.get(key)
    if table is None:
        table = _table_cache[key] = {**base, torch.Tensor: _reduce_tensor}
    return table


def _reduce_tensor(t: Any) -> tuple[Any, ...]:
    """Plain CPU tensors travel as raw bytes (out-of-band when big); others use torch's way."""
    torch = sys.modules["torch"]
    plain = (
        t.device.type == "cpu" and t.layout == torch.strided and not t.requires_grad
        and not t.is_quantized and not t.is_conj() and not t.is_neg()
    )
    if not plain:
        return t.__reduce_ex__(5)
    dtype = str(t.dtype).removeprefix("torch.")
    flat = t.contiguous().reshape(-1)
    if flat.numel() == 0:
        return _rebuild_tensor, (bytearray(), dtype, tuple(t.shape))
    raw = flat.view(torch.uint8).numpy()
    return _rebuild_tensor, (pickle.PickleBuffer(raw), dtype, tuple(t.shape))


def _rebuild_tensor(buf: Any, dtype_name: str, shape: tuple[int, ...]) -> Any:
    import torch

    dtype = getattr(torch, dtype_name)
    view = memoryview(buf)
    if view.nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    if view.readonly:  # keep received tensors writable
        buf = bytearray(view)
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).reshape(shape)


# ---- ring chunk frames --------------------------------------------------------------------


def write_overflow_marker(dst: memoryview) -> None:
    _HDR.pack_into(dst, 0, OVERFLOW, 0, 0)


def frame_kind(src: memoryview) -> int:
    return _HDR.unpack_from(src, 0)[0]


def read_inline(src: memoryview) -> Any:
    """Decode a message from a chunk; nothing returned aliases the chunk."""
    main, *views = inline_frames(src)
    oob = [bytearray(v) for v in views]  # the one copy of each buffer on the reader side
    try:
        return pickle.loads(main, buffers=oob)
    finally:
        for v in (main, *views):
            v.release()  # the mapping cannot be closed while a view of it is alive


def decode_frames(frames: list[Any]) -> Any:
    """Decode [pickle stream, *oob] received from ZMQ; buffers become writable copies."""
    oob = [bytearray(memoryview(f)) for f in frames[1:]]
    return pickle.loads(memoryview(frames[0]), buffers=oob)
