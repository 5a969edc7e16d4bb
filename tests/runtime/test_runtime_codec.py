"""runtime.codec: round trips of every message kind, zero-copy arrays, forward compatibility, fuzzing."""
from __future__ import annotations

import dataclasses
import random
import struct
from collections.abc import Callable
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from runtime import codec
from runtime.errors import DecodeError, LocalViolation
from runtime.messages import (
    MESSAGE_TYPES,
    Activation,
    Hop,
    InferenceRequest,
    InferenceResult,
    Message,
)

from runtime_strategies import DTYPES, arrays, assert_same, bounded, iter_arrays, records

KINDS = sorted(MESSAGE_TYPES)
_HEADER = struct.Struct("<4sI")


def _owner(arr: np.ndarray) -> Any:
    """The object at the end of an array's ``base`` chain."""
    base: Any = arr
    while isinstance(base, np.ndarray) and base.base is not None:
        base = base.base
    return base.obj if isinstance(base, memoryview) else base


def assert_zero_copy(msg: Message, frame: bytes) -> None:
    frame_arr = np.frombuffer(frame, np.uint8)
    for arr in iter_arrays(msg):
        assert not arr.flags.writeable, "decoded arrays must be read-only"
        assert _owner(arr) is frame, "decoded array does not view the frame"
        if arr.nbytes:
            assert np.shares_memory(arr, frame_arr)


# ------------------------------------------------------------------ round trips


@pytest.mark.parametrize("kind", KINDS)
@bounded(40)
@given(data=st.data())
def test_round_trip_every_kind(kind: str, data: st.DataObject) -> None:
    msg = data.draw(records(MESSAGE_TYPES[kind]))
    frame = codec.encode(msg)
    out = codec.decode(frame)
    assert_same(msg, out)
    assert_zero_copy(out, frame)
    assert codec.encode(out) == frame  # re-encoding a decoded message is stable


def test_every_kind_is_registered_under_its_class() -> None:
    assert KINDS, "no message types registered"
    for kind, cls in MESSAGE_TYPES.items():
        assert kind == cls.KIND and issubclass(cls, Message)


@bounded(80)
@given(arr=arrays())
def test_arrays_any_dtype_and_shape(arr: np.ndarray) -> None:
    msg = InferenceResult("r", True, tensors={"x": arr, "y": arr[..., :1] if arr.ndim else arr})
    frame = codec.encode(msg)
    out = codec.decode(frame)
    assert_same(msg, out)
    assert_zero_copy(out, frame)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_zero_d_empty_and_noncontiguous(dtype: np.dtype) -> None:
    base = np.arange(24).astype(dtype).reshape(4, 6)
    cases = {
        "scalar": np.array(7, dtype=dtype),
        "empty": np.zeros((0, 3), dtype=dtype),
        "empty1d": np.zeros(0, dtype=dtype),
        "transposed": base.T,
        "strided": base[::2, ::3],
        "fortran": np.asfortranarray(base),
    }
    frame = codec.encode(InferenceRequest("q", "w", "reply", cases))
    out = codec.decode(frame)
    assert isinstance(out, InferenceRequest)
    for name, arr in cases.items():
        got = out.tensors[name]
        assert got.shape == arr.shape and got.dtype == arr.dtype
        assert np.array_equal(got, arr), name
    assert_zero_copy(out, frame)


def test_arrays_are_64_byte_aligned() -> None:
    tensors = {f"t{i}": np.arange(i + 1, dtype="<f8") for i in range(5)}
    frame = codec.encode(InferenceRequest("q", "w", "reply", tensors))
    out = codec.decode(frame)
    base = np.frombuffer(frame, np.uint8).ctypes.data
    for arr in out.tensors.values():
        assert (arr.ctypes.data - base) % 64 == 0


@pytest.mark.parametrize("buf", [bytes, bytearray, memoryview], ids=lambda t: t.__name__)
def test_decode_accepts_buffers_and_arrays_stay_read_only(buf: Callable[[bytes], Any]) -> None:
    frame = codec.encode(InferenceResult("r", True, tensors={"x": np.ones(5, "<f4")}))
    out = codec.decode(buf(bytearray(frame)))
    arr = out.tensors["x"]
    assert not arr.flags.writeable
    with pytest.raises(ValueError):
        arr[0] = 2.0


@pytest.mark.parametrize("bad", [
    np.array(["a", "b"]),  # unicode
    np.array([b"a"]),  # bytes
    np.array([object()], dtype=object),
    np.zeros(2, dtype="M8[s]"),
    np.zeros(2, dtype=[("a", "<i4")]),
], ids=["unicode", "bytes", "object", "datetime", "structured"])
def test_encode_refuses_unsafe_dtypes(bad: np.ndarray) -> None:
    with pytest.raises(LocalViolation):
        codec.encode(InferenceResult("r", True, tensors={"x": bad}))


def test_encode_refuses_non_messages() -> None:
    with pytest.raises(LocalViolation):
        codec.encode({"kind": "dev.death"})  # type: ignore[arg-type]


# ------------------------------------------------------------------ frame surgery


def split(frame: bytes) -> tuple[Any, bytes | None]:
    """(meta with array ext values kept opaque, data section) of a frame."""
    _, meta_len = _HEADER.unpack_from(frame, 0)
    end = _HEADER.size + meta_len
    meta = msgpack.unpackb(frame[_HEADER.size:end], raw=False, ext_hook=msgpack.ExtType)
    base = end + (-end) % 64
    has_arrays = len(frame) > end or _has_ext(meta)  # the encoder aligns a data section, even an empty one
    return meta, (frame[base:] if has_arrays else None)


def _has_ext(value: Any) -> bool:
    if isinstance(value, msgpack.ExtType):
        return True
    if isinstance(value, (list, tuple)):
        return any(_has_ext(v) for v in value)
    if isinstance(value, dict):
        return any(_has_ext(v) for v in value.values())
    return False


def join(meta: Any, data: bytes | None = None, magic: bytes = codec.MAGIC) -> bytes:
    """A frame around ``meta``; a data section (even empty) is aligned as the encoder does."""
    raw = msgpack.packb(meta, use_bin_type=True)
    head = _HEADER.pack(magic, len(raw))
    if data is None:
        return head + raw
    return head + raw + b"\x00" * ((-(len(head) + len(raw))) % 64) + data


def rewrite(frame: bytes, edit: Callable[[dict[str, Any]], None]) -> bytes:
    meta, data = split(frame)
    edit(meta[2])
    return join(meta, data)


# ------------------------------------------------------------------ forward compatibility


def _spec(cls: type) -> list[tuple[str, bool]]:
    return [(s.name, s.required) for s in cls._fields]


@pytest.mark.parametrize("kind", KINDS)
@bounded(15)
@given(data=st.data(), extra=st.dictionaries(st.text(min_size=1, max_size=8).map(lambda s: "x_" + s),
                                             st.none() | st.integers(-(2**63), 2**64 - 1) | st.text(max_size=5)
                                             | st.lists(st.integers(-9, 9), max_size=3), min_size=1, max_size=3))
def test_unknown_fields_are_tolerated(kind: str, data: st.DataObject, extra: dict[str, Any]) -> None:
    msg = data.draw(records(MESSAGE_TYPES[kind]))
    frame = rewrite(codec.encode(msg), lambda body: body.update(extra))
    assert_same(msg, codec.decode(frame))


@pytest.mark.parametrize("kind", KINDS)
@bounded(10)
@given(data=st.data())
def test_missing_optional_fields_get_defaults(kind: str, data: st.DataObject) -> None:
    cls = MESSAGE_TYPES[kind]
    msg = data.draw(records(cls))
    optional = [f for f in dataclasses.fields(cls) if f.name in {n for n, req in _spec(cls) if not req}]
    frame = rewrite(codec.encode(msg), lambda body: [body.pop(f.name) for f in optional])
    out = codec.decode(frame)
    for f in dataclasses.fields(cls):
        if f in optional:
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
            assert_same(default, getattr(out, f.name), f.name)
        else:
            assert_same(getattr(msg, f.name), getattr(out, f.name), f.name)


@pytest.mark.parametrize("kind,field", [(k, n) for k in KINDS for n, req in _spec(MESSAGE_TYPES[k]) if req])
@bounded(5)
@given(data=st.data())
def test_missing_required_field_is_decode_error(kind: str, field: str, data: st.DataObject) -> None:
    msg = data.draw(records(MESSAGE_TYPES[kind]))
    frame = rewrite(codec.encode(msg), lambda body: body.pop(field))
    with pytest.raises(DecodeError, match="missing field"):
        codec.decode(frame)


def test_unknown_fields_in_nested_records_are_tolerated() -> None:
    msg = Activation("r", "w", (Hop("d1", "w", 1, 0, 0), Hop("d2", "w", 1, 0, 1)), 1, "reply",
                     {"x": np.arange(4, dtype="<f4")})

    def edit(body: dict[str, Any]) -> None:
        for i, hop in enumerate(body["route"]):
            hop["gpu_hint"] = ["newer", "peer", i]

    assert_same(msg, codec.decode(rewrite(codec.encode(msg), edit)))


def test_newer_protocol_version_number_in_meta_is_tolerated() -> None:
    frame = codec.encode(Activation("r", "w", (Hop("d", "w", 1, 0, 0),), 0, "reply", {"x": np.arange(3)}))
    meta, data = split(frame)
    meta[1] = 7
    out = codec.decode(join(meta, data))
    assert isinstance(out, Activation) and np.array_equal(out.tensors["x"], np.arange(3))


# ------------------------------------------------------------------ rejections


def _valid() -> bytes:
    return codec.encode(InferenceResult("r", True, tensors={"x": np.arange(6, dtype="<i4").reshape(2, 3)}))


def _with_array_header(header: Any) -> bytes:
    meta, data = split(_valid())
    meta[2]["tensors"]["x"] = msgpack.ExtType(1, msgpack.packb(header))
    return join(meta, data)


CRAFTED: dict[str, Callable[[], bytes]] = {
    "empty": lambda: b"",
    "short header": lambda: b"FGL",
    "bad magic": lambda: b"XYZ\x01" + _valid()[4:],
    "future frame version": lambda: b"FGL\x02" + _valid()[4:],
    "meta length past end": lambda: _HEADER.pack(codec.MAGIC, 2**32 - 1) + b"\x90",
    "trailing bytes in meta": lambda: _trailing(),
    "meta not a list": lambda: join({"kind": "cmd.ack"}),
    "meta too short": lambda: join(["cmd.ack", 1]),
    "kind not str": lambda: join([5, 1, {}]),
    "body not map": lambda: join(["cmd.ack", 1, [1, 2]]),
    "unknown kind": lambda: join(["no.such.kind", 1, {}]),
    "wrong field type": lambda: join(["cmd.ack", 1, {"command_id": 1, "device_id": "d", "ok": True}]),
    "bool for int": lambda: join(["dev.death", 1, {"device_id": "d", "epoch": True}]),
    "validate fails": lambda: join(["dev.death", 1, {"device_id": "a/b", "epoch": 1}]),
    "nested record not map": lambda: join(["inf.activation", 1, {
        "request_id": "r", "workload": "w", "route": [1], "hop": 0, "reply_to": "x", "tensors": {}}]),
    "tuple field not list": lambda: join(["inf.activation", 1, {
        "request_id": "r", "workload": "w", "route": "abc", "hop": 0, "reply_to": "x", "tensors": {}}]),
    "non-str map key": lambda: join(["cmd.ack", 1, {1: "x"}]),
    "array where str expected": lambda: rewrite(_valid(), lambda b: b.update(request_id=b["tensors"]["x"])),
    "unknown ext code": lambda: join(["inf.result", 1, {"request_id": "r", "ok": True,
                                                        "tensors": {"x": msgpack.ExtType(9, b"")}}]),
    "object dtype": lambda: _with_array_header(["|O", [1], 0, 8]),
    "unicode dtype": lambda: _with_array_header(["<U2", [1], 0, 8]),
    "datetime dtype": lambda: _with_array_header(["<M8[s]", [1], 0, 8]),
    "structured dtype": lambda: _with_array_header([[["a", "<i4"]], [1], 0, 4]),
    "garbage dtype": lambda: _with_array_header(["not-a-dtype", [1], 0, 4]),
    "dtype not str": lambda: _with_array_header([3, [1], 0, 4]),
    "negative dim": lambda: _with_array_header(["<i4", [-1], 0, 4]),
    "shape not list": lambda: _with_array_header(["<i4", 6, 0, 24]),
    "shape of floats": lambda: _with_array_header(["<i4", [6.0], 0, 24]),
    "nbytes disagrees": lambda: _with_array_header(["<i4", [2, 3], 0, 20]),
    "past the frame": lambda: _with_array_header(["<i4", [2, 3], 64, 24]),
    "negative offset": lambda: _with_array_header(["<i4", [2, 3], -64, 24]),
    "float offset": lambda: _with_array_header(["<i4", [2, 3], 0.5, 24]),
    "huge shape": lambda: _with_array_header(["<i4", [2**62, 2**62], 0, 24]),
    "zero-size huge dims": lambda: _with_array_header(["<i4", [0, 2**62, 2**62], 0, 0]),
    "too many dims": lambda: _with_array_header(["<i4", [1] * 70, 0, 4]),
    "header too short": lambda: _with_array_header(["<i4", [2, 3]]),
    "header not list": lambda: _with_array_header({"dtype": "<i4"}),
    "deep nesting": lambda: _deep_frame(5000),
}


def _trailing() -> bytes:
    raw = msgpack.packb(["dev.death", 1, {"device_id": "d", "epoch": 1}]) + b"\x01"
    return _HEADER.pack(codec.MAGIC, len(raw)) + raw


def _deep_frame(n: int) -> bytes:
    """An extra field nested ``n`` lists deep (msgpack itself refuses to pack that)."""
    raw = msgpack.packb(["cmd.ack", 1, {"command_id": "c", "device_id": "d", "ok": True}])
    assert raw[10] == 0x83  # fixarray, "cmd.ack" (8 bytes), 1 -> the body's fixmap header
    raw = raw[:10] + b"\x84" + raw[11:] + msgpack.packb("x") + b"\x91" * n + b"\x90"
    return _HEADER.pack(codec.MAGIC, len(raw)) + raw


@pytest.mark.parametrize("name", list(CRAFTED))
def test_crafted_frames_raise_decode_error_only(name: str) -> None:
    frame = CRAFTED[name]()
    with pytest.raises(DecodeError):
        codec.decode(frame)


def test_decode_error_is_a_value_error() -> None:
    assert issubclass(DecodeError, ValueError)


def test_oversized_is_refused_before_parsing() -> None:
    frame = _valid()
    with pytest.raises(DecodeError, match="exceeds"):
        codec.decode(frame, max_size=len(frame) - 1)
    assert isinstance(codec.decode(frame, max_size=len(frame)), InferenceResult)
    assert codec.DEFAULT_MAX_SIZE == 16 * 1024 * 1024
    with pytest.raises(DecodeError, match="exceeds"):
        codec.decode(b"\x00" * (codec.DEFAULT_MAX_SIZE + 1))


# ------------------------------------------------------------------ fuzzing


def _random_msgpack(rng: random.Random, depth: int = 0) -> Any:
    choice = rng.randrange(9 if depth < 3 else 6)
    if choice == 0:
        return None
    if choice == 1:
        return rng.choice([True, False])
    if choice == 2:
        return rng.choice([0, -1, 1, 2**31, -(2**63), 2**64 - 1, rng.randrange(-1000, 1000)])
    if choice == 3:
        return rng.choice([0.0, -1.5, float("nan"), float("inf"), rng.random()])
    if choice == 4:
        return rng.choice(["", "dev.birth", "x" * rng.randrange(50), "a/b", "\u00e9"])
    if choice == 5:
        return rng.randbytes(rng.randrange(40))
    if choice == 6:
        return [_random_msgpack(rng, depth + 1) for _ in range(rng.randrange(5))]
    if choice == 7:
        return {rng.choice(["device_id", "epoch", "tensors", "k", "route", "ok"]): _random_msgpack(rng, depth + 1)
                for _ in range(rng.randrange(5))}
    return msgpack.ExtType(rng.choice([1, 1, 2]), msgpack.packb(
        [rng.choice(["<f4", "|b1", "<i8", "|O", 4]), [rng.randrange(-2, 5) for _ in range(rng.randrange(4))],
         rng.randrange(-64, 256), rng.randrange(-8, 256)]))


def _mutate(rng: random.Random, corpus: list[bytes]) -> bytes:
    frame = rng.choice(corpus)
    op = rng.randrange(8)
    if op == 0:  # bit flips
        b = bytearray(frame)
        for _ in range(rng.randrange(1, 4)):
            i = rng.randrange(len(b))
            b[i] ^= 1 << rng.randrange(8)
        return bytes(b)
    if op == 1:  # random byte overwrite, biased to the header and metadata
        b = bytearray(frame)
        i = rng.randrange(min(len(b), 80))
        b[i] = rng.randrange(256)
        return bytes(b)
    if op == 2:  # truncation
        return frame[:rng.randrange(len(frame))]
    if op == 3:  # splice two valid frames
        other = rng.choice(corpus)
        return frame[:rng.randrange(len(frame))] + other[rng.randrange(len(other)):]
    if op == 4:  # random bytes
        return rng.randbytes(rng.randrange(200))
    if op == 5:  # random msgpack as metadata
        return join(_random_msgpack(rng), rng.randbytes(rng.randrange(0, 128)))
    if op == 6:  # a known kind with a random body
        return join([rng.choice(KINDS), 1, {k: _random_msgpack(rng) for k in
                                          rng.sample([s.name for s in MESSAGE_TYPES[rng.choice(KINDS)]._fields]
                                                     + ["zz"], 2)}])
    meta, data = split(frame)  # a valid body with one field replaced by junk
    if meta[2]:
        meta[2][rng.choice(list(meta[2]))] = _random_msgpack(rng)
    return join(meta, data)


def _check(data: bytes, outcomes: dict[str, int]) -> None:
    try:
        msg = codec.decode(data)
    except DecodeError:
        outcomes["rejected"] += 1
    except Exception as exc:  # noqa: BLE001 - any other exception is the bug looked for  # pragma: no cover
        pytest.fail(f"{data[:64]!r}... raised {type(exc).__name__}: {exc}")
    else:
        assert isinstance(msg, Message)
        outcomes["decoded"] += 1


def test_fuzz_only_decode_error_escapes() -> None:
    """>= 10,000 mutated and random inputs: decode returns a Message or raises DecodeError."""
    rng = random.Random(20261121)
    corpus: list[bytes] = []
    outcomes = {"decoded": 0, "rejected": 0}
    per_example = 30

    @bounded(360)
    @given(data=st.data())
    def run(data: st.DataObject) -> None:
        kind = data.draw(st.sampled_from(KINDS))
        frame = codec.encode(data.draw(records(MESSAGE_TYPES[kind])))
        corpus.append(frame)
        del corpus[:-64]
        for _ in range(per_example):
            _check(_mutate(rng, corpus), outcomes)

    run()
    total = sum(outcomes.values())
    assert total >= 10_000, outcomes
    assert outcomes["rejected"] > total // 2, outcomes  # the mutations really reach the error paths


@bounded(300)
@given(st.binary(max_size=300))
def test_fuzz_arbitrary_bytes(data: bytes) -> None:
    for candidate in (data, codec.MAGIC + data, _HEADER.pack(codec.MAGIC, len(data)) + data):
        try:
            codec.decode(candidate)
        except DecodeError:
            pass
