"""Measured segment times from the devices themselves (pure).

Every agent times each partition once when it loads it (``PartitionStatus.calib_s``:
one request's compute on that device). The fog spreads that time over the
partition's segments in proportion to their FLOPs and keeps the result per
(workload, version, device class). Segments not yet measured on a class are
filled in at the speed (seconds per FLOP) its measured segments ran at, so one
partition is enough to calibrate a class; the scheduler gets the times
(``ChainProfile.segment_times``) and places later work by them instead of by
FLOPs over a peak throughput. A
class is the device's ``device-class`` or ``device-model`` label, else the device
itself. No clock, no I/O: the service calls ``note`` with what it heard.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .placement.model import ChainProfile

__all__ = ["CalibrationBook", "split_by_flops", "device_class", "throughput", "MIN_THROUGHPUT_S"]


def device_class(device_id: str, labels: dict[str, str]) -> str:
    """What measured times are keyed by (as ``Device.device_class``), or the device id."""
    return labels.get("device-class") or labels.get("device-model") or device_id


def split_by_flops(profile: ChainProfile, first: int, last: int, seconds: float) -> dict[int, float]:
    """One partition's measured seconds over its segments, in proportion to their FLOPs."""
    segs = profile.segments[first:last + 1]
    total = sum(s.flops for s in segs)
    if total <= 0:
        return {first + i: seconds / len(segs) for i in range(len(segs))}
    return {first + i: seconds * s.flops / total for i, s in enumerate(segs)}


#: Shorter calibrations say little about throughput: a run's fixed cost (tens of microseconds in
#: onnxruntime) would dominate and make an honest device look slow.
MIN_THROUGHPUT_S = 1e-4


def throughput(profile: ChainProfile, first: int, last: int, seconds: float) -> float:
    """FLOP/s one partition's calibration showed (0.0 when it says nothing): the device's
    measured compute, which replaces its claimed ``flops`` in placement and checks the claim."""
    if not seconds >= MIN_THROUGHPUT_S or not 0 <= first <= last < len(profile.segments):
        return 0.0
    return sum(s.flops for s in profile.segments[first:last + 1]) / seconds


@dataclass
class _Entry:
    times: dict[int, float] = field(default_factory=dict)
    applied: tuple[float, ...] = ()


class CalibrationBook:
    """Measured seconds per segment, per (workload, version, device class)."""

    def __init__(self, change: float = 0.2) -> None:
        self.change = change  # a full set is handed out again only when a segment moved this much
        self._book: dict[tuple[str, int, str], _Entry] = {}

    def note(self, workload: str, version: int, cls: str, profile: ChainProfile, first: int, last: int,
             seconds: float) -> tuple[float, ...] | None:
        """Record a partition's calibration; the full per-segment times when they are new, else None."""
        if not seconds > 0 or not 0 <= first <= last < len(profile.segments):
            return None
        e = self._book.setdefault((workload, version, cls), _Entry())
        e.times.update(split_by_flops(profile, first, last, seconds))
        flops = sum(profile.segments[i].flops for i in e.times)
        per_flop = sum(e.times.values()) / flops if flops > 0 else 0.0
        full = tuple(e.times.get(i, s.flops * per_flop) for i, s in enumerate(profile.segments))
        if e.applied and all(abs(a - b) <= self.change * max(b, 1e-9) for a, b in zip(full, e.applied)):
            return None
        e.applied = full
        return full

    def forget(self, workload: str) -> None:
        for k in [k for k in self._book if k[0] == workload]:
            del self._book[k]
