"""runtime.codec memory bounds: decode bombs are refused before they are built; real frames decode as before.

The attack frames are 16 MiB (the default max_size) of msgpack that used to decode to
0.4-1.4 GB of Python objects. Peak memory is measured in a fresh subprocess (its peak RSS
before and after ``decode``), so nothing this process allocated earlier can hide it.
"""
from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from runtime import codec
from runtime.errors import DecodeError
from runtime.messages import (
    CommandAck,
    Deploy,
    DeviceSummary,
    Envelope,
    FleetSummary,
    InferenceRequest,
)
from runtime.security import Identity, Signer

from runtime_strategies import bounded

REPO = Path(__file__).resolve().parents[2]
MIB = 1024 * 1024
_HEADER = struct.Struct("<4sI")


def frame_of(meta: bytes, data: bytes = b"") -> bytes:
    """A frame around raw msgpack metadata (and an optional data section)."""
    head = _HEADER.pack(codec.MAGIC, len(meta))
    pad = b"\x00" * ((-(len(head) + len(meta))) % 64) if data else b""
    return head + meta + pad + data


def array32(n: int, unit: bytes) -> bytes:
    return b"\xdd" + n.to_bytes(4, "big") + unit * n


_EXT_HDR = msgpack.packb(["|u1", [], 0, 1])  # a 0-d uint8 view of the data section's first byte
_EXT = b"\xc7" + bytes([len(_EXT_HDR)]) + b"\x01" + _EXT_HDR


def attack(kind: str, size: int = codec.DEFAULT_MAX_SIZE) -> bytes:
    """A frame of at most ``size`` bytes built to expand in memory."""
    room = size - _HEADER.size - 5 - 128
    units = {
        "empty arrays": b"\x90",                       # [[], [], ...]: 1 byte -> a 56-byte list
        "nested arrays": b"\x91" * 500 + b"\x90",      # [[[[...[]...]]]] 500 deep, repeated
        "map bomb": b"\x81\xa0\x80",                   # [{"": {}}, ...]
        "short strings": b"\xa2ab",                    # ["ab", ...]: 3 bytes -> a 51-byte str
        "tiny arrays (ext)": _EXT,                      # array views: ~13 bytes -> an ndarray each
    }
    unit = units[kind]
    frame = frame_of(array32(room // len(unit), unit), b"\x07" * 64)
    assert len(frame) <= size
    return frame


ATTACKS = ["empty arrays", "nested arrays", "map bomb", "short strings", "tiny arrays (ext)"]

# Peak RSS of this process image: VmHWM (Linux), not ru_maxrss, which a child inherits from
# the parent it was forked from (a big pytest process would hide the growth).
_CHILD = """
import json, resource, sys
from pathlib import Path
from runtime import codec
from runtime.errors import DecodeError

def peak_kb():
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

frame = Path(sys.argv[1]).read_bytes()
before = peak_kb()
try:
    codec.decode(frame)
    error = None
except DecodeError as exc:
    error = str(exc)
after = peak_kb()
print(json.dumps({"growth_mb": (after - before) / 1024, "error": error}))
"""


def decode_in_child(frame: bytes, tmp_path: Path) -> dict[str, Any]:
    path = tmp_path / "frame.bin"
    path.write_bytes(frame)
    out = subprocess.run([sys.executable, "-c", _CHILD, str(path)], cwd=REPO, capture_output=True,
                         timeout=120, check=True)
    return json.loads(out.stdout)  # type: ignore[no-any-return]


@pytest.mark.integration
@pytest.mark.parametrize("kind", ATTACKS)
def test_attack_frames_are_refused_in_bounded_memory(kind: str, tmp_path: Path) -> None:
    got = decode_in_child(attack(kind), tmp_path)
    assert got["error"] is not None and "object budget exceeded" in got["error"]
    # before: 0.4-1.4 GB; the walk refuses it having built nothing (measured ~0 MB)
    assert got["growth_mb"] < 200, got


@pytest.mark.integration
def test_a_frame_just_under_the_budget_costs_what_the_budget_says(tmp_path: Path) -> None:
    """The worst a frame can do once admitted: ~1M empty maps (docs: ~70 B an object)."""
    got = decode_in_child(frame_of(array32(codec.DEFAULT_MAX_OBJECTS - 1, b"\x80")), tmp_path)
    assert got["error"] == "metadata is not [kind, version, body]"
    assert 10 < got["growth_mb"] < 200, got  # > 10: the measurement sees real growth


@pytest.mark.parametrize("kind", ATTACKS)
def test_attack_frames_raise_decode_error_in_process(kind: str) -> None:
    with pytest.raises(DecodeError, match="object budget exceeded"):
        codec.decode(attack(kind))


# ------------------------------------------------------------------ the budgets, exactly


def _count(value: Any) -> int:
    """msgpack objects in a value, as the walk counts them."""
    if isinstance(value, msgpack.ExtType):  # a namedtuple, but one object on the wire
        return 1
    if isinstance(value, (list, tuple)):
        return 1 + sum(_count(v) for v in value)
    if isinstance(value, dict):
        return 1 + sum(_count(k) + _count(v) for k, v in value.items())
    return 1


_leaves = (st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats(allow_nan=False, width=32)
           | st.text(max_size=40) | st.binary(max_size=40)
           | st.builds(msgpack.ExtType, st.integers(0, 127), st.binary(max_size=20)))
_values = st.recursive(_leaves, lambda inner: st.lists(inner, max_size=20)
                       | st.dictionaries(st.text(max_size=8), inner, max_size=20), max_leaves=60)


@bounded(300)
@given(value=_values, single_float=st.booleans())
def test_walk_counts_exactly_what_msgpack_builds(value: Any, single_float: bool) -> None:
    packed = memoryview(msgpack.packb(value, use_bin_type=True, use_single_float=single_float))
    n = _count(value)
    codec._check_budget(packed, n)
    with pytest.raises(DecodeError, match="object budget exceeded"):
        codec._check_budget(packed, n - 1)
    if len(packed) > 1:
        with pytest.raises(DecodeError):
            codec._check_budget(packed[:-1], n)


@pytest.mark.parametrize("value", [
    "x" * 300, "y" * 70_000, b"z" * 300, b"z" * 70_000,                 # str/bin 16 and 32
    [None] * 20, [None] * 70_000, {str(i): i for i in range(20)}, {str(i): i for i in range(70_000)},
    msgpack.ExtType(5, b"a" * 300), msgpack.ExtType(5, b"a" * 70_000),
    [msgpack.ExtType(1, b"a" * n) for n in (1, 2, 4, 8, 16, 3)],          # fixext and ext8
    [2**7, 2**15, 2**31, 2**63, -(2**7), -(2**15), -(2**31), -(2**63), 1.5],
])
def test_walk_handles_every_size_class(value: Any) -> None:
    packed = memoryview(msgpack.packb(value, use_bin_type=True))
    codec._check_budget(packed, _count(value))
    with pytest.raises(DecodeError):
        codec._check_budget(packed, _count(value) - 1)


def test_walk_refuses_counts_the_bytes_cannot_hold_and_the_unused_type() -> None:
    with pytest.raises(DecodeError, match="truncated"):
        codec._check_budget(memoryview(b"\xdd\xff\xff\xff\xff" + b"\x90" * 100), 10**12)
    with pytest.raises(DecodeError, match="0xc1"):
        codec._check_budget(memoryview(b"\x92\x90\xc1"), 100)


@pytest.mark.parametrize("budget", [20, 40, 1000])
def test_budget_edge_on_a_real_message(budget: int) -> None:
    msg = FleetSummary("fog-1", "s", 1.0, tuple(DeviceSummary(f"d{i}", True) for i in range(3)))
    frame = codec.encode(msg)
    objects = 4 + 2 * 4 + 3 * 23  # [kind, version, {4 fields}], 3 devices of 11 fields
    if budget >= objects:
        assert codec.decode(frame, max_objects=budget) == msg
    else:
        with pytest.raises(DecodeError, match="object budget exceeded"):
            codec.decode(frame, max_objects=budget)
    assert codec.decode(frame, max_objects=objects) == msg


def test_short_metadata_needs_no_walk_because_bytes_bound_objects() -> None:
    # 1000 empty arrays in 1005 bytes of metadata: under a budget of 2000 objects nothing is walked
    meta = array32(1000, b"\x90")
    with pytest.raises(DecodeError, match="not \\[kind, version, body\\]"):
        codec.decode(frame_of(meta), max_objects=2000)
    with pytest.raises(DecodeError, match="object budget exceeded"):
        codec.decode(frame_of(meta), max_objects=999)


# ------------------------------------------------------------------ array views and their headers


def _tensors_frame(n: int) -> bytes:
    return codec.encode(InferenceRequest("r", "w", "fogline/v1/s/reply/c",
                                         {f"t{i}": np.arange(2, dtype=np.int8) for i in range(n)}))


def test_array_budget() -> None:
    assert len(codec.decode(_tensors_frame(10), max_arrays=10).tensors) == 10  # type: ignore[attr-defined]
    with pytest.raises(DecodeError, match="array budget exceeded"):
        codec.decode(_tensors_frame(11), max_arrays=10)
    with pytest.raises(DecodeError, match="array budget exceeded"):
        codec.decode(attack("tiny arrays (ext)", 200_000))


@pytest.mark.parametrize("header", [
    ["<f4", [1] * 200, 0, 4],                 # an ext payload over 1 KiB
    ["<f4" * 10, [1], 0, 4],                  # a dtype string no real dtype needs
    ["<f4", [1], 0],                          # three fields
    [["<f4"], [1], 0, 4],                     # dtype not a string
    ["<f4", [1], 0.0, 4],                     # offset not an int
    ["<f4", [1], 0, 4, "extra"],
    "<f4",
])
def test_bad_array_headers(header: Any) -> None:
    ext = msgpack.ExtType(1, msgpack.packb(header))
    meta = msgpack.packb(["inf.request", 1, {"request_id": "r", "workload": "w", "reply_to": "x",
                                             "tensors": {"a": ext}}], use_bin_type=True)
    with pytest.raises(DecodeError):
        codec.decode(frame_of(meta, b"\x00" * 64))


# ------------------------------------------------------------------ legitimate frames: as before


def test_deploy_with_a_multi_mb_artifact_decodes() -> None:
    artifact = np.random.default_rng(1).bytes(8 * MIB)
    msg = Deploy("c1", "w", 1, 0, 0, "a" * 64, artifact, b"s" * 64, "fog", 10**8, ("x",), ("y",), {"k": "v"})
    frame = codec.encode(msg)
    assert len(frame) > codec.DEFAULT_MAX_OBJECTS  # long metadata: walked, and the bin is skipped
    assert codec.decode(frame) == msg


def test_inference_request_with_a_1mb_tensor_is_zero_copy() -> None:
    arr = np.random.default_rng(0).standard_normal(MIB // 4, dtype=np.float32)
    frame = codec.encode(InferenceRequest("req-1", "resnet", "fogline/v1/s/reply/c", {"input": arr}))
    frame_arr = np.frombuffer(frame, np.uint8)
    for max_objects in (codec.DEFAULT_MAX_OBJECTS, 30):  # no walk, and walked
        out = codec.decode(frame, max_objects=max_objects)
        got = out.tensors["input"]  # type: ignore[attr-defined]
        assert np.array_equal(got, arr) and not got.flags.writeable and np.shares_memory(got, frame_arr)


# ------------------------------------------------------------------ envelopes: the tight budget


def test_decode_envelope() -> None:
    frame = Signer(Identity.from_seed("d", b"d"), 1).seal_bytes(CommandAck("c", "d", True), 1.0)
    env = codec.decode_envelope(frame)
    assert isinstance(env, Envelope) and env == codec.decode(frame)
    with pytest.raises(DecodeError, match="expected an envelope"):
        codec.decode_envelope(codec.encode(CommandAck("c", "d", True)))
    # an envelope padded with an unknown field holding 100 empty arrays: fine for decode
    # (forward compatible), over the envelope budget
    body = {"sender": "d", "epoch": 1, "seq": 1, "timestamp": 1.0, "payload": b"p", "signature": b"s" * 64,
            "x_future": [[]] * 100}
    padded = frame_of(msgpack.packb(["env", 1, body], use_bin_type=True))
    assert isinstance(codec.decode(padded), Envelope)
    with pytest.raises(DecodeError, match="object budget exceeded"):
        codec.decode_envelope(padded)
    with pytest.raises(DecodeError, match="object budget exceeded"):
        codec.decode_envelope(attack("empty arrays"))


# ------------------------------------------------------------------ fuzz: still only DecodeError


@bounded(300)
@given(data=st.binary(max_size=400), budget=st.integers(1, 64), arrays=st.integers(0, 4))
def test_any_bytes_with_any_budget_raise_only_decode_error(data: bytes, budget: int, arrays: int) -> None:
    for candidate in (data, frame_of(data), frame_of(data, b"\x00" * 64)):
        try:
            codec.decode(candidate, max_objects=budget, max_arrays=arrays)
        except DecodeError:
            pass
