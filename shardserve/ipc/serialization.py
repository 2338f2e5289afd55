"""Pickle protocol 5 with out-of-band buffers, and the frame written into a ring chunk.

Big buffers (numpy arrays, CPU torch tensors of ``oob_threshold`` bytes or more) are not copied
into the pickle stream: the pickler hands them to us as raw memoryviews and the writer copies
each one straight into the ring chunk (copy 1); the reader copies it out into a fresh, writable
``bytearray`` (copy 2, unavoidable: the chunk is reused ``max_chunks`` messages later, so a
received array must not alias it) and the unpickler builds the array on top of that bytearray.

Frame inside a chunk (little endian)::

    0        4        8                  align64(8 + 8 * nbuf)
    +--------+--------+------------------+------------------+-----+------------------+
    | kind   | nbuf   | u64 len[nbuf]    | buffer 0: pickle | ... | buffer nbuf-1    |
    +--------+--------+------------------+------------------+-----+------------------+

``kind`` is INLINE (the message is in this chunk) or OVERFLOW (the chunk is only a marker; the
message follows on the ZMQ socket in the same order). Every buffer starts 64-byte aligned.
"""

from __future__ import annotations

import copyreg
import io
import pickle
import struct
import sys
from collections.abc import Mapping
from typing import Any

INLINE = 1
OVERFLOW = 2
_HDR = struct.Struct("<II")
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
    """A pickled message: the pickle stream plus its out-of-band buffers."""

    __slots__ = ("main", "oob", "framed_size")

    def __init__(self, main: memoryview, oob: list[memoryview]) -> None:
        self.main, self.oob = main, oob
        size = _align(8 + 8 * (1 + len(oob))) + _align(main.nbytes)
        self.framed_size = size + sum(_align(b.nbytes) for b in oob)

    def frames(self) -> list[memoryview]:
        """[pickle stream, *out-of-band buffers], for a ZMQ multipart message."""
        return [self.main, *self.oob]


def encode(obj: Any, oob_threshold: int) -> Encoded:
    oob: list[memoryview] = []

    def keep_in_band(buf: pickle.PickleBuffer) -> bool:
        try:
            raw = buf.raw()
        except BufferError:  # not contiguous: let pickle copy it in-band
            return True
        if raw.nbytes < oob_threshold:
            return True
        oob.append(raw)
        return False

    f = io.BytesIO()
    try:
        _pickler(f, keep_in_band, pickle.Pickler).dump(obj)
    except (pickle.PicklingError, AttributeError, TypeError):
        # Lambdas, local classes and the like: cloudpickle handles them and its output loads
        # with the plain unpickler.
        import cloudpickle

        oob.clear()
        f = io.BytesIO()
        _pickler(f, keep_in_band, cloudpickle.Pickler).dump(obj)
    return Encoded(f.getbuffer(), oob)


def _pickler(f: io.BytesIO, callback: Any, cls: type) -> pickle.Pickler:
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


def decode(main: Any, oob: list[Any]) -> Any:
    return pickle.loads(main, buffers=oob)


# ---- ring chunk frames --------------------------------------------------------------------


def write_inline(dst: memoryview, enc: Encoded) -> None:
    """Copy the message into a chunk (the one copy on the writer side)."""
    bufs = enc.frames()
    _HDR.pack_into(dst, 0, INLINE, len(bufs))
    _lens_struct(len(bufs)).pack_into(dst, 8, *(b.nbytes for b in bufs))
    off = _align(8 + 8 * len(bufs))
    for b in bufs:
        n = b.nbytes
        dst[off : off + n] = b.cast("B") if b.format != "B" or b.ndim != 1 else b
        off += _align(n)


def write_overflow_marker(dst: memoryview) -> None:
    _HDR.pack_into(dst, 0, OVERFLOW, 0)


def frame_kind(src: memoryview) -> int:
    return _HDR.unpack_from(src, 0)[0]


def read_inline(src: memoryview) -> Any:
    """Decode a message from a chunk; nothing returned aliases the chunk."""
    _, nbuf = _HDR.unpack_from(src, 0)
    lens = _lens_struct(nbuf).unpack_from(src, 8)
    off = _align(8 + 8 * nbuf)
    main = src[off : off + lens[0]]
    off += _align(lens[0])
    oob = []
    for n in lens[1:]:
        oob.append(bytearray(src[off : off + n]))  # the one copy on the reader side
        off += _align(n)
    try:
        return pickle.loads(main, buffers=oob)
    finally:
        main.release()  # the mapping cannot be closed while a view of it is alive


def decode_frames(frames: list[Any]) -> Any:
    """Decode [pickle stream, *oob] received from ZMQ; buffers become writable copies."""
    oob = [bytearray(memoryview(f)) for f in frames[1:]]
    return pickle.loads(memoryview(frames[0]), buffers=oob)
