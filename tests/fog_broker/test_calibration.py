"""Measured segment times from partition calibrations (fog_broker.calibration, pure)."""
from __future__ import annotations

import pytest

from fog_broker.calibration import CalibrationBook, device_class, split_by_flops
from fog_broker.placement.model import ChainProfile, Device

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


def test_one_partition_calibrates_a_class_and_times_change_only_when_they_move() -> None:
    book = CalibrationBook(change=0.2)
    # half the chain measured: the rest at the speed it ran at (1 ms per MFLOP here)
    assert book.note("w", 1, "pi4", PROFILE, 0, 1, 0.004) == pytest.approx((0.001, 0.003, 0.0, 0.004))
    full = book.note("w", 1, "pi4", PROFILE, 2, 3, 0.008)                   # the rest ran twice as slowly
    assert full == pytest.approx((0.001, 0.003, 0.0, 0.008))
    assert book.note("w", 1, "pi4", PROFILE, 0, 1, 0.0041) is None         # within 20 %: nothing new
    moved = book.note("w", 1, "pi4", PROFILE, 0, 1, 0.008)                  # twice as slow now
    assert moved == pytest.approx((0.002, 0.006, 0.0, 0.008))
    assert book.note("w", 1, "pi5", PROFILE, 0, 3, 0.0) is None             # no calibration reported
    assert book.note("w", 1, "pi5", PROFILE, 0, 9, 0.1) is None             # a range the chain does not have
    assert book.note("w", 2, "pi4", PROFILE, 0, 3, 0.008) == pytest.approx((0.001, 0.003, 0.0, 0.004))
    book.forget("w")
    assert book.note("w", 1, "pi4", PROFILE, 2, 3, 0.004) == pytest.approx((0.001, 0.003, 0.0, 0.004))


def test_the_class_key_matches_what_the_scheduler_looks_up() -> None:
    dev = Device.from_dict({"id": "d7", "flops": 1e9, "memory_bytes": 1e9, "uplink_bps": 1e8, "downlink_bps": 1e8,
                            "rtt_s": 0.001, "power_active_w": 5, "power_idle_w": 2,
                            "labels": {"device-model": "pi4"}})
    cls = device_class(dev.id, dict(dev.labels))
    assert cls == dev.device_class == "pi4"
    timed = PROFILE.with_times({cls: (0.001, 0.003, 0.0, 0.008)})
    assert timed.compute_s(0, 3, dev) == pytest.approx(0.012)   # measured, not FLOPs / device FLOPs
    assert device_class("d8", {}) == "d8"
