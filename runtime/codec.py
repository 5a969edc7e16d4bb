"""The one wire codec: msgpack metadata plus numpy arrays carried out of band.

Frame layout (all integers little endian)::

    b"FGL" version:u8 meta_len:u32 meta(msgpack) pad-to-64 | array bytes, each 64-aligned

``meta`` is ``[kind, version, body]``. Each array in ``body`` is an msgpack
ext (code 1) holding ``[dtype, shape, offset, nbytes]`` into the data section,
so ``decode`` returns read-only numpy views of the input buffer: no copy, no
pickle, no object dtypes. ``decode`` raises ``DecodeError`` (a ``ValueError``)
for anything wrong with the bytes and never any other exception.

Memory is bounded before anything is built. One msgpack byte can become a
~70-byte Python object (an empty list or map), so 16 MiB of ``0x90`` used to
decode to ~1.2 GB. ``decode`` therefore admits at most ``max_objects``
msgpack objects and ``max_arrays`` array views per frame: metadata no longer
than ``max_objects`` bytes cannot hold more objects than that (each takes at
least one byte), and longer metadata is first walked by ``_check_budget``,
which builds nothing and stops at the budget. A frame then costs at most
about ``len(data)`` (str/bin copies; up to 4x for str in the worst UTF-8 mix)
plus ~70 B x ``max_objects`` plus ~1 KB x ``max_arrays``: with the defaults
under ~100 MB whatever the input (measured: 68 MB for 1M empty maps, against
1.1-1.4 GB before), and a 16 MiB bomb is refused by the walk in ~0.15 s
having allocated nothing. Legitimate large frames are few objects and many
bytes (an ONNX artifact is one ``bin``), so the walk skips over them.
Envelopes, decoded before any signature check, get the tight
``ENVELOPE_MAX_OBJECTS`` budget (``decode_envelope``).
"""
from __future__ import annotations

import struct
from typing import Any

import msgpack
import numpy as np

from ._schema import from_wire, to_wire
from .errors import DecodeError, LocalViolation, OutOfRange
from .messages import MESSAGE_TYPES, Envelope, Message

__all__ = ["encode", "decode", "decode_envelope", "DEFAULT_MAX_SIZE", "DEFAULT_MAX_OBJECTS",
           "DEFAULT_MAX_ARRAYS", "ENVELOPE_MAX_OBJECTS", "MAGIC"]

MAGIC = b"FGL\x01"
DEFAULT_MAX_SIZE = 16 * 1024 * 1024
# A FleetSummary of 10k devices is ~210k objects; 1M leaves room and caps a frame at ~70 MB of objects.
DEFAULT_MAX_OBJECTS = 1_000_000
DEFAULT_MAX_ARRAYS = 4096  # tensors per message; a model's layers are a few hundred at most
# An envelope is [kind, version, {6 fields}] = 16 objects; room for a few future fields, no more.
ENVELOPE_MAX_OBJECTS = 64
_HEADER = struct.Struct("<4sI")
_ALIGN = 64
_EXT_ARRAY = 1
_ALLOWED_KINDS = frozenset("biufc")  # bool, ints, floats, complex: never object or void
_MAX_EXT_LEN = 1024  # an array header: short dtype string, <= 64 dims (numpy's limit) of <= 9 bytes, ...


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
            view = arr.data.cast("B") if arr.nbytes else memoryview(b"")
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


def _scan_table() -> tuple[tuple[int, int, int, int] | None, ...]:
    """Per msgpack type byte: (header bytes, objects it holds, width of a size field, size multiplier).

    With a size field, the size is a body length (multiplier 0: str, bin, ext) or an item count
    (1: array, 2: map). None: 0xc1, never used.
    """
    table: list[tuple[int, int, int, int] | None] = []
    for b in range(256):
        if b < 0x80 or b >= 0xe0:
            table.append((1, 0, 0, 0))  # fixints
        elif b < 0x90:
            table.append((1, 2 * (b & 0x0F), 0, 0))  # fixmap
        elif b < 0xA0:
            table.append((1, b & 0x0F, 0, 0))  # fixarray
        elif b < 0xC0:
            table.append((1 + (b & 0x1F), 0, 0, 0))  # fixstr
        else:
            table.append(None)
    for b, size in ((0xC0, 1), (0xC2, 1), (0xC3, 1), (0xCA, 5), (0xCB, 9), (0xCC, 2), (0xCD, 3), (0xCE, 5),
                    (0xCF, 9), (0xD0, 2), (0xD1, 3), (0xD2, 5), (0xD3, 9), (0xD4, 3), (0xD5, 4), (0xD6, 6),
                    (0xD7, 10), (0xD8, 18)):  # nil, bools, floats, ints, fixext
        table[b] = (size, 0, 0, 0)
    for b, width in ((0xC4, 1), (0xC5, 2), (0xC6, 4), (0xD9, 1), (0xDA, 2), (0xDB, 4)):  # bin, str
        table[b] = (1 + width, 0, width, 0)
    for b, width in ((0xC7, 1), (0xC8, 2), (0xC9, 4)):  # ext: the type byte follows the length
        table[b] = (2 + width, 0, width, 0)
    for b, width, mult in ((0xDC, 2, 1), (0xDD, 4, 1), (0xDE, 2, 2), (0xDF, 4, 2)):  # array, map
        table[b] = (1 + width, 0, width, mult)
    return tuple(table)


_SCAN = _scan_table()


def _check_budget(buf: memoryview, budget: int) -> None:
    """Count the msgpack objects in ``buf`` without building any; raise past ``budget``.

    Only headers are read (str/bin/ext bodies are skipped), so a large artifact
    costs nothing and a bomb costs at most ``budget`` steps (~80 ns each).
    """
    n = len(buf)
    pos = 0
    pending = 1  # objects still to read; each needs at least one byte
    count = 0
    table = _SCAN
    while pending:
        if pos >= n:
            raise DecodeError("truncated metadata")
        entry = table[buf[pos]]
        if entry is None:
            raise DecodeError("invalid msgpack type byte 0xc1")
        step, add, width, mult = entry
        if width:
            if pos + 1 + width > n:
                raise DecodeError("truncated metadata")
            size = int.from_bytes(buf[pos + 1:pos + 1 + width], "big")
            if mult:
                add = size * mult
            else:
                step += size
        pos += step
        pending += add - 1
        count += 1
        if count > budget:
            raise DecodeError(f"object budget exceeded (more than {budget} objects)")
        if pending > n - pos:
            raise DecodeError("truncated metadata")


def _array_hook(data: memoryview, base: int, max_arrays: int) -> Any:
    made = 0

    def hook(code: int, payload: bytes) -> Any:
        nonlocal made
        if code != _EXT_ARRAY:
            raise DecodeError(f"unknown ext type {code}")
        made += 1
        if made > max_arrays:
            raise DecodeError(f"array budget exceeded (more than {max_arrays} arrays)")
        # payload is at most _MAX_EXT_LEN bytes (the outer max_ext_len), so this is small; a header
        # of the wrong shape or types fails below with ValueError/TypeError, which decode relabels
        dtype_s, shape, offset, nbytes = msgpack.unpackb(payload)
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


def decode(data: bytes | bytearray | memoryview, *, max_size: int = DEFAULT_MAX_SIZE,
           max_objects: int = DEFAULT_MAX_OBJECTS, max_arrays: int = DEFAULT_MAX_ARRAYS) -> Message:
    """Parse one frame into its message; arrays are read-only views into ``data``.

    ``max_objects`` and ``max_arrays`` bound the memory a frame can cost (see the module doc).
    """
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
        meta = view[_HEADER.size:meta_end]
        if meta_len > max_objects:  # shorter metadata cannot hold more objects than bytes
            _check_budget(meta, max_objects)
        base = meta_end + _pad(meta_end)
        items = meta_len if meta_len < max_objects else max_objects
        body = msgpack.unpackb(meta, ext_hook=_array_hook(view, base, max_arrays), raw=False,
                               strict_map_key=True, use_list=True, max_str_len=meta_len,
                               max_bin_len=meta_len, max_array_len=items, max_map_len=items // 2 + 1,
                               max_ext_len=_MAX_EXT_LEN)
        if not (isinstance(body, list) and len(body) == 3 and isinstance(body[0], str)
                and isinstance(body[2], dict)):
            raise DecodeError("metadata is not [kind, version, body]")
        cls = MESSAGE_TYPES.get(body[0])
        if cls is None:
            raise DecodeError(f"unknown message kind {body[0][:40]!r}")
        return from_wire(cls, body[2])
    except DecodeError:
        raise
    except OutOfRange as exc:  # a well-formed message with one figure outside its range: say which
        raise DecodeError(f"{type(exc).__name__}: {exc}"[:300], out_of_range=exc) from None
    except (ValueError, TypeError, KeyError, IndexError, OverflowError, RecursionError,
            MemoryError, struct.error, msgpack.UnpackException) as exc:
        raise DecodeError(f"{type(exc).__name__}: {exc}"[:300]) from None
    except Exception as exc:  # noqa: BLE001 - decode's contract: one error type, whatever the bytes
        raise DecodeError(f"undecodable input ({type(exc).__name__})") from None


def decode_envelope(data: bytes | bytearray | memoryview, *, max_size: int = DEFAULT_MAX_SIZE) -> Envelope:
    """Decode a signed ``Envelope`` under the tight envelope budget (it is read before any signature check)."""
    env = decode(data, max_size=max_size, max_objects=ENVELOPE_MAX_OBJECTS, max_arrays=0)
    if not isinstance(env, Envelope):
        raise DecodeError(f"expected an envelope, got {env.KIND}")
    return env
