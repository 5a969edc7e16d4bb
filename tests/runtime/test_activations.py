"""Compressed activations: sizes, errors, the chooser, and bounded, strict decoding."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime import codec
from runtime.activations import (
    AccuracyBound,
    ActivationError,
    choose_wires,
    decode,
    encode,
    rel_error,
    wire_bytes,
)
from runtime.errors import DecodeError
from runtime.messages import Tensors


def _act(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    # channels with very different ranges: what per-channel scales are for
    x = rng.standard_normal((1, 16, 20, 20)).astype(np.float32)
    x *= np.logspace(-2, 1, 16, dtype=np.float32)[None, :, None, None]
    return {"x": x, "ids": np.arange(4, dtype=np.int64)}


@pytest.mark.parametrize("wire,ratio,err", [("float32", 1.0, 0.0), ("float16", 2.0, 1e-3),
                                            ("int8", 4.0, 0.05), ("int8c", 4.0, 0.01)])
def test_round_trip_sizes_and_errors(wire: str, ratio: float, err: float) -> None:
    t = _act()
    enc = encode(t, wire)
    back = decode(enc, wire)
    assert set(back) == set(t) and back["x"].dtype == np.float32 and back["x"].shape == (1, 16, 20, 20)
    assert np.array_equal(back["ids"], t["ids"])  # not float32: untouched
    raw = t["x"].nbytes
    got = wire_bytes(enc) - t["ids"].nbytes
    assert got <= raw / ratio + 16 * 4
    assert rel_error(t, wire) <= err


def test_per_channel_beats_per_tensor_on_uneven_channels() -> None:
    t = _act()
    assert rel_error(t, "int8c") < rel_error(t, "int8") / 2


def test_encoded_frame_survives_the_codec() -> None:
    enc = encode(_act(), "int8c")
    msg = codec.decode(codec.encode(Tensors(enc)))
    assert isinstance(msg, Tensors)
    assert np.allclose(decode(dict(msg.tensors), "int8c")["x"], decode(enc, "int8c")["x"])


def test_zeros_nans_and_huge_values_do_not_break_encoding() -> None:
    x = np.array([[0.0, 0.0], [np.nan, 1e30]], dtype=np.float32)
    for w in ("float16", "int8", "int8c"):
        back = decode(encode({"x": x}, w), w)["x"]
        assert back.dtype == np.float32 and back.shape == x.shape
    assert np.array_equal(decode(encode({"z": np.zeros((1, 3), np.float32)}, "int8c"), "int8c")["z"],
                          np.zeros((1, 3), np.float32))


def test_plain_tensors_decode_on_any_cut() -> None:
    t = _act()
    for w in ("float32", "float16", "int8", "int8c", ""):
        assert np.array_equal(decode(t, w)["x"], t["x"])


# -- bad input: a peer that does not follow the encoding ------------------------------------

def _bad(tensors: dict[str, np.ndarray], wire: str, match: str, **kw: int) -> None:
    with pytest.raises(ActivationError, match=match) as exc:
        decode(tensors, wire, **kw)
    assert isinstance(exc.value, DecodeError) and "\n" not in str(exc.value)


def test_encoding_other_than_the_cuts_is_refused() -> None:
    _bad(encode(_act(), "int8"), "float16", "int8 on a float16 cut")
    _bad(encode(_act(), "float16"), "int8", "float16 on a int8 cut")
    _bad(encode(_act(), "int8c"), "int8", "per-channel scale on an int8 cut")
    _bad(encode(_act(), "int8"), "float32", "int8 on a float32 cut")


def test_malformed_scales_are_refused() -> None:
    enc = encode(_act(), "int8c")
    _bad({k: v for k, v in enc.items() if not k.startswith("\0s")}, "int8c", "without its scale")
    for bad in (np.zeros(16, np.float32), np.full(16, np.inf, np.float32),
                np.ones(16, np.float64), np.ones(5, np.float32), np.ones((16, 1), np.float32)):
        _bad({**enc, "\0s\0x": bad}, "int8c", "scale")
    _bad({**enc, "\0s\0y": np.ones(1, np.float32)}, "int8c", "scale without")


def test_wrong_dtypes_unknown_tags_and_clashes_are_refused() -> None:
    _bad({"\0q\0x": np.zeros(4, np.int16), "\0s\0x": np.ones(1, np.float32)}, "int8", "int8 expected")
    _bad({"\0h\0x": np.zeros(4, np.float32)}, "float16", "float16 expected")
    _bad({"\0z\0x": np.zeros(4, np.float32)}, "int8", "unknown encoded tensor")
    _bad({"x": np.zeros(4, np.float32), "\0h\0x": np.zeros(4, np.float16)}, "float16", "twice")
    _bad({}, "int4", "unknown activation wire")


def test_decoding_is_bounded() -> None:
    """A small frame may not decode to unbounded memory: the element budget stops it first."""
    enc = encode({"x": np.ones((1, 8, 64, 64), np.float32)}, "int8")
    _bad(enc, "int8", "decoded elements", max_elements=1000)
    half = encode({"x": np.ones((1, 8, 64, 64), np.float32)}, "float16")
    _bad(half, "float16", "decoded elements", max_elements=1000)


@settings(max_examples=60, deadline=None)
@given(data=st.dictionaries(st.text(min_size=0, max_size=6),
                            st.sampled_from([np.int8, np.float16, np.float32, np.float64, np.int64]),
                            max_size=4),
       tags=st.lists(st.sampled_from(["\0q\0", "\0h\0", "\0s\0", "\0", ""]), min_size=4, max_size=4),
       wire=st.sampled_from(["float32", "float16", "int8", "int8c"]))
def test_arbitrary_input_decodes_or_fails_cleanly(data: dict[str, type], tags: list[str],
                                                   wire: str) -> None:
    t = {tag + k: np.ones((1, 3, 2), dt) for (k, dt), tag in zip(data.items(), tags)}
    try:
        out = decode(t, wire)
    except ActivationError:
        return
    assert all(not k.startswith("\0") for k in out)


# -- the chooser -------------------------------------------------------------------------------

def test_choose_most_compact_under_rel_error() -> None:
    cuts = [[_act(s) for s in range(3)], [_act(10 + s) for s in range(3)]]
    got, _ = choose_wires(cuts, AccuracyBound(max_rel_error=0.01))  # per-tensor int8: ~0.02
    assert [c.wire for c in got] == ["int8c", "int8c"]
    assert all(c.float32_bytes >= 3.5 * (c.wire_bytes - 32) for c in got)
    got, _ = choose_wires(cuts, AccuracyBound(max_rel_error=1e-3))
    assert [c.wire for c in got] == ["float16", "float16"]
    assert all(c.rel_error <= 1e-3 and c.float32_bytes >= 1.9 * c.wire_bytes for c in got)


def test_per_tensor_int8_first_when_it_meets_the_bound() -> None:
    """One scale per tensor is the fewest bytes (4x fewer than float32 up to the scale): a loose
    bound takes it; per-channel only when per-tensor misses the bound."""
    cuts = [[_act(s) for s in range(3)]]
    got, _ = choose_wires(cuts, AccuracyBound(max_rel_error=0.2))
    assert got[0].wire == "int8"
    assert got[0].wire_bytes < choose_wires(cuts, AccuracyBound(max_rel_error=0.01))[0][0].wire_bytes
    top1, _ = choose_wires(cuts, AccuracyBound(min_top1=0.99), lambda wires: 1.0)
    assert top1[0].wire == "int8"


def test_unmeetable_bound_falls_back_to_float32_and_says_so() -> None:
    got, _ = choose_wires([[_act()]], AccuracyBound(max_rel_error=1e-9))
    assert got[0].wire == "float32" and got[0].wire_bytes == got[0].float32_bytes
    assert "no encoding meets the accuracy bound" in got[0].note
    assert got[0].to_dict()["note"] == got[0].note


def test_no_bound_means_float32() -> None:
    got, top1 = choose_wires([[_act()]], AccuracyBound())
    assert got[0].wire == "float32" and top1 is None


def test_top1_bound_steps_back_the_worst_cut() -> None:
    """A fake model whose answer survives float16 but not int8 anywhere."""
    calls: list[tuple[str, ...]] = []

    def top1(wires: list[str]) -> float:
        calls.append(tuple(wires))
        return 1.0 if all(w in ("float16", "float32") for w in wires) else 0.5

    got, agree = choose_wires([[_act()], [_act(1)]], AccuracyBound(min_top1=0.99), top1)
    assert [c.wire for c in got] == ["float16", "float16"] and agree == 1.0
