"""Measured segment times from partition calibrations (fog_broker.calibration, pure)."""
from __future__ import annotations

import pytest

from fog_broker.calibration import CalibrationBook, split_by_flops
from fog_broker.placement.model import ChainProfile, Device, class_label

PROFILE = ChainProfile.from_dict({"model": "m", "input_bytes": 100, "segments": [
    {"flops": 1e6, "param_bytes": 10, "activation_bytes": 10, "out_bytes": 10},
    {"flops": 3e6, "param_bytes": 10, "activation_bytes": 10, "out_bytes": 10},
    {"flops": 0.0, "param_bytes": 10, "activation_bytes": 10, "out_bytes": 10},
    {"flops": 4e6, "param_bytes": 10, "activation_bytes": 10, "out_bytes": 10},
]})


@pytest.mark.parametrize("first, last, seconds, want", [
    (0, 1, 0.004, {0: 0.001, 1: 0.003}),
    (2, 3, 0.008, {2: 0.0, 3: 0.008}),
    (2, 2, 0.002, {2: 0.002}),  # no FLOPs at all: the time is shared equally
])
def test_a_partition_time_is_shared_by_flops(first: int, last: int, seconds: float, want: dict[int, float]) -> None:
    got = split_by_flops(PROFILE, first, last, seconds)
    assert got.keys() == want.keys() and all(got[k] == pytest.approx(v) for k, v in want.items())


def test_one_partition_calibrates_a_device_and_times_change_only_when_they_move() -> None:
    book = CalibrationBook(change=0.2)
    # half the chain measured: the rest at the speed it ran at (1 ms per MFLOP here)
    got = book.note("w", 1, "d1", "", PROFILE, 0, 1, 0.004)
    assert list(got) == ["d1"] and got["d1"] == pytest.approx((0.001, 0.003, 0.0, 0.004))
    full = book.note("w", 1, "d1", "", PROFILE, 2, 3, 0.008)["d1"]        # the rest ran twice as slowly
    assert full == pytest.approx((0.001, 0.003, 0.0, 0.008))
    assert book.note("w", 1, "d1", "", PROFILE, 0, 1, 0.0041) == {}        # within 20 %: nothing new
    moved = book.note("w", 1, "d1", "", PROFILE, 0, 1, 0.008)["d1"]        # twice as slow now
    assert moved == pytest.approx((0.002, 0.006, 0.0, 0.008))
    assert book.note("w", 1, "d2", "", PROFILE, 0, 3, 0.0) == {}           # no calibration reported
    assert book.note("w", 1, "d2", "", PROFILE, 0, 9, 0.1) == {}           # a range the chain does not have
    assert book.note("w", 2, "d1", "", PROFILE, 0, 3, 0.008)["d1"] == pytest.approx((0.001, 0.003, 0.0, 0.004))
    book.forget("w")
    assert book.note("w", 1, "d1", "", PROFILE, 2, 3, 0.004)["d1"] == pytest.approx((0.001, 0.003, 0.0, 0.004))


def test_a_class_is_the_upper_median_of_its_devices_and_keyed_apart_from_ids() -> None:
    book = CalibrationBook()
    one = book.note("w", 1, "a", "pi4", PROFILE, 0, 3, 0.008)
    assert one.keys() == {"a", "class:pi4"} and one["class:pi4"] == one["a"]
    # a liar of the class reports 100x faster: the class keeps the honest (slower) figure
    two = book.note("w", 1, "liar", "pi4", PROFILE, 0, 3, 0.00008)
    assert two.keys() == {"liar"} and two["liar"] == pytest.approx((1e-5, 3e-5, 0.0, 4e-5))
    three = book.note("w", 1, "c", "pi4", PROFILE, 0, 3, 0.032)           # two honest, one liar
    assert three.keys() == {"c"}                                            # the median: still a's
    four = book.note("w", 1, "d", "pi4", PROFILE, 0, 3, 0.032)             # now c's (upper median)
    assert four["class:pi4"] == pytest.approx((0.004, 0.012, 0.0, 0.016))
    left = book.note("w", 1, "d", "orin", PROFILE, 0, 3, 0.032)            # d moves class
    assert left.keys() == {"class:orin", "class:pi4"}                       # pi4 = {a, liar, c}: a's again
    assert left["class:pi4"] == pytest.approx((0.001, 0.003, 0.0, 0.004))


def test_the_class_key_matches_what_the_scheduler_looks_up() -> None:
    dev = Device.from_dict({"id": "d7", "flops": 1e9, "memory_bytes": 1e9, "uplink_bps": 1e8, "downlink_bps": 1e8,
                            "rtt_s": 0.001, "power_active_w": 5, "power_idle_w": 2,
                            "labels": {"device-model": "pi4"}})
    assert dev.device_class == class_label(dict(dev.labels)) == "pi4"
    timed = PROFILE.with_times(CalibrationBook().note("w", 1, "d0", "pi4", PROFILE, 0, 3, 0.012))
    assert timed.compute_s(0, 3, dev) == pytest.approx(0.012)   # measured, not FLOPs / device FLOPs
    assert class_label({"device-class": "d7"}, {"d7", "d8"}) == ""  # a class never names a device


def test_a_refuted_device_is_measured_by_the_fog_and_leaves_its_class() -> None:
    """The router saw a liar's chain take 40 ms: that is its time; its own reports are ignored after."""
    book = CalibrationBook()
    book.note("w", 1, "a", "pi4", PROFILE, 0, 3, 0.008)
    book.note("w", 1, "b", "pi4", PROFILE, 0, 3, 0.008)
    book.note("w", 1, "liar", "pi4", PROFILE, 0, 3, 0.00005)
    got = book.refute("w", 1, "liar", PROFILE, 0, 3, 0.040)
    assert got["liar"] == pytest.approx((0.005, 0.015, 0.0, 0.020))
    assert book.note("w", 1, "liar", "pi4", PROFILE, 0, 3, 0.00005) == {}  # never trusted again
    # a class is built only from members not refuted: the liar's figure moves no class
    c = book.note("w", 1, "c", "pi4", PROFILE, 0, 3, 0.0001)
    assert c.get("class:pi4") is None or c["class:pi4"] == pytest.approx((0.001, 0.003, 0.0, 0.004))
    book.forget_device("liar")
    assert "liar" in book.note("w", 1, "liar", "pi4", PROFILE, 0, 3, 0.008)
