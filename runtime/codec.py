"""The one wire codec: msgpack metadata plus numpy arrays carried out of band.

Frame layout (all integers little endian)::

    b"FGL" version:u8 meta_len:u32 meta(msgpack) pad-to-64 | array bytes, each 64-aligned

``meta`` is ``[kind, version, body]``. Each array in ``body`` is an msgpack
ext (code 1) holding ``[dtype, shape, offset, nbytes]`` into the data section,
so ``decode`` returns read-only numpy views of the input buffer: no copy, no
pickle, no object dtypes. ``decode`` raises ``DecodeError`` (a ``ValueError``)
for anything wrong with the bytes and never any other exception.
"""
from __future__ import annotations

import struct
from typing import Any

import msgpack
import numpy as np

from ._schema import from_wire, to_wire
from .errors import DecodeError, LocalViolation
from .messages import MESSAGE_TYPES, Message

__all__ = ["encode", "decode", "DEFAULT_MAX_SIZE", "MAGIC"]

MAGIC = b"FGL\x01"
DEFAULT_MAX_SIZE = 16 * 1024 * 1024
_HEADER = struct.Struct("<4sI")
_ALIGN = 64
_EXT_ARRAY = 1
_ALLOWED_KINDS = frozenset("biufc")  # bool, ints, floats, complex: never object or void


def _pad(n: int) -> int:
    return (-n) % _ALIGN


def encode(msg: Message) -> bytes:
    """Serialise a message; arrays are laid out raw after the metadata."""
    if not isinstance(msg, Message):
        raise LocalViolation(f"encode() takes a Message, not {type(msg).__name__}")
    buffers: list[memoryview] = []
    offset = 0

    def default(obj: Any) -> Any:
        nonlocal offset
        if isinstance(obj, np.ndarray):
            if obj.dtype.kind not in _ALLOWED_KINDS:
                raise LocalViolation(f"cannot send arrays of dtype {obj.dtype}")
            arr = np.ascontiguousarray(obj)
            view = memoryview(arr).cast("B") if arr.nbytes else memoryview(b"")
            start = offset
            buffers.append(view)
            offset += arr.nbytes + _pad(arr.nbytes)
            # obj.shape, not arr.shape: ascontiguousarray turns a 0-d array into shape (1,)
            header = msgpack.packb([arr.dtype.str, list(obj.shape), start, arr.nbytes])
            return msgpack.ExtType(_EXT_ARRAY, header)
        raise LocalViolation(f"cannot encode {type(obj).__name__}")

    meta = msgpack.packb([msg.KIND, msg.VERSION, to_wire(msg)], default=default, use_bin_type=True)
    head = _HEADER.pack(MAGIC, len(meta))
    parts: list[bytes | memoryview] = [head, meta]
    if buffers:
        parts.append(b"\x00" * _pad(len(head) + len(meta)))
    for view in buffers:
        parts.append(view)
        parts.append(b"\x00" * _pad(len(view)))
    return b"".join(parts)


def _array_hook(data: memoryview, base: int) -> Any:
    def hook(code: int, payload: bytes) -> Any:
        if code != _EXT_ARRAY:
            raise DecodeError(f"unknown ext type {code}")
        dtype_s, shape, offset, nbytes = msgpack.unpackb(payload, use_list=True)
        dtype = np.dtype(dtype_s)
        if dtype.kind not in _ALLOWED_KINDS or dtype.hasobject:
            raise DecodeError(f"dtype {dtype_s!r} not allowed")
        if not isinstance(shape, list) or not all(isinstance(s, int) and s >= 0 for s in shape):
            raise DecodeError("bad array shape")
        count = 1
        for s in shape:
            count *= s
        if count * dtype.itemsize != nbytes or offset < 0 or base + offset + nbytes > len(data):
            raise DecodeError("array extends past the frame or disagrees with its shape")
        arr = np.frombuffer(data, dtype=dtype, count=count, offset=base + offset)
        return arr.reshape(shape)

    return hook


def decode(data: bytes | bytearray | memoryview, *, max_size: int = DEFAULT_MAX_SIZE) -> Message:
    """Parse one frame into its message; arrays are read-only views into ``data``."""
    try:
        if len(data) > max_size:
            raise DecodeError(f"message of {len(data)} bytes exceeds the {max_size}-byte limit")
        if len(data) < _HEADER.size:
            raise DecodeError("truncated frame header")
        magic, meta_len = _HEADER.unpack_from(data, 0)
        if magic != MAGIC:
            raise DecodeError("not a Fogline frame (bad magic or version)")
        meta_end = _HEADER.size + meta_len
        if meta_end > len(data):
            raise DecodeError("truncated metadata")
        view = memoryview(data).toreadonly() if not isinstance(data, bytes) else memoryview(data)
        base = meta_end + _pad(meta_end)
        meta = msgpack.unpackb(view[_HEADER.size:meta_end], ext_hook=_array_hook(view, base),
                               raw=False, strict_map_key=True, use_list=True)
        if not (isinstance(meta, list) and len(meta) == 3 and isinstance(meta[0], str)
                and isinstance(meta[2], dict)):
            raise DecodeError("metadata is not [kind, version, body]")
        cls = MESSAGE_TYPES.get(meta[0])
        if cls is None:
            raise DecodeError(f"unknown message kind {meta[0][:40]!r}")
        return from_wire(cls, meta[2])  # type: ignore[no-any-return]
    except DecodeError:
        raise
    except (ValueError, TypeError, KeyError, IndexError, OverflowError, RecursionError,
            MemoryError, struct.error, msgpack.UnpackException) as exc:
        raise DecodeError(f"{type(exc).__name__}: {exc}"[:300]) from None
    except Exception as exc:  # noqa: BLE001 - decode's contract: one error type, whatever the bytes
        raise DecodeError(f"undecodable input ({type(exc).__name__})") from None
