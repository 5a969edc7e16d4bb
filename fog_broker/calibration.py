"""Measured segment times from the devices themselves (pure).

Every agent times each partition once when it loads it (``PartitionStatus.calib_s``:
one request's compute on that device). The fog spreads that time over the
partition's segments in proportion to their FLOPs and keeps the result per
(workload, version, device). Segments not yet measured on a device are filled
in at the speed (seconds per FLOP) its measured segments ran at, so one
partition is enough to calibrate a device; the scheduler gets the times
(``ChainProfile.segment_times``) and places later work by them instead of by
FLOPs over a peak throughput.

A device's times are keyed by the id the broker authenticated (the registry's),
never by a label. A class's times (``class:NAME``, a namespace no device id is
in) are the per-segment upper median over the devices of that class the fog
knows: one liar among its class cannot make the class look faster, and nobody's
label reaches another device's own times. A device whose claims the router's observed round
trips refuted (``claim_check``) is measured by the fog instead: its times are the observed ones,
its own reports are ignored from then on, and it counts towards no class. No clock, no I/O: the
service calls ``note`` with what it heard.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from statistics import median_high

from .placement.model import ChainProfile, class_key

__all__ = ["CalibrationBook", "split_by_flops", "throughput", "MIN_THROUGHPUT_S"]


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
    full: tuple[float, ...] = ()
    applied: tuple[float, ...] = ()
    cls: str = ""


class CalibrationBook:
    """Measured seconds per segment, per (workload, version, device); classes built from them."""

    def __init__(self, change: float = 0.2) -> None:
        self.change = change  # a full set is handed out again only when a segment moved this much
        self._book: dict[tuple[str, int], dict[str, _Entry]] = {}       # (w, v) -> device id ->
        self._classes: dict[tuple[str, int, str], tuple[float, ...]] = {}  # (w, v, class) -> applied
        self._refuted: set[str] = set()  # devices whose claims the router refuted: measured by the fog

    def note(self, workload: str, version: int, device_id: str, cls: str, profile: ChainProfile,
             first: int, last: int, seconds: float) -> dict[str, tuple[float, ...]]:
        """Record a partition's calibration on ``device_id`` (of class ``cls``, '' for none, as the
        registry vouches for it); the per-segment times that moved enough to hand out again, keyed
        as ``ChainProfile.segment_times`` takes them (the device id, ``class:NAME``)."""
        if device_id in self._refuted:
            return {}  # its word on its speed counts no more (``refute``)
        return self._note(workload, version, device_id, cls, profile, first, last, seconds)

    def refute(self, workload: str, version: int, device_id: str, profile: ChainProfile, first: int,
               last: int, observed_s: float) -> dict[str, tuple[float, ...]]:
        """The router saw segments ``first..last`` take ``observed_s`` on ``device_id``, far above its
        claims: that is its time from now on (its later reports are ignored), and it leaves its class."""
        self._refuted.add(device_id)
        devices = self._book.get((workload, version), {})
        cls = devices[device_id].cls if device_id in devices else ""
        out = self._note(workload, version, device_id, "", profile, first, last, observed_s, replace=True)
        if cls:  # the class without it
            out.update(self._class_times(workload, version, cls))
        return out

    def _note(self, workload: str, version: int, device_id: str, cls: str, profile: ChainProfile,
              first: int, last: int, seconds: float, replace: bool = False) -> dict[str, tuple[float, ...]]:
        if not seconds > 0 or not 0 <= first <= last < len(profile.segments):
            return {}
        devices = self._book.setdefault((workload, version), {})
        if replace:
            devices.pop(device_id, None)
        e = devices.setdefault(device_id, _Entry())
        e.times.update(split_by_flops(profile, first, last, seconds))
        flops = sum(profile.segments[i].flops for i in e.times)
        per_flop = sum(e.times.values()) / flops if flops > 0 else 0.0
        e.full = tuple(e.times.get(i, s.flops * per_flop) for i, s in enumerate(profile.segments))
        out: dict[str, tuple[float, ...]] = {}
        if self._moved(e.full, e.applied):
            e.applied = out[device_id] = e.full
        old, e.cls = e.cls, cls
        for c in sorted({old, cls} - {""}):  # its class now, and the one it left (it no longer counts there)
            out.update(self._class_times(workload, version, c))
        return out

    def _class_times(self, workload: str, version: int, c: str) -> dict[str, tuple[float, ...]]:
        """Class ``c``'s times when they moved: the upper median over its members the router has not refuted."""
        members = [x.full for d, x in self._book.get((workload, version), {}).items()
                   if x.cls == c and d not in self._refuted]
        times = tuple(median_high(col) for col in zip(*members)) if members else ()
        if times and self._moved(times, self._classes.get((workload, version, c), ())):
            self._classes[(workload, version, c)] = times
            return {class_key(c): times}
        return {}

    def _moved(self, full: tuple[float, ...], applied: tuple[float, ...]) -> bool:
        return not applied or any(abs(a - b) > self.change * max(b, 1e-9) for a, b in zip(full, applied))

    def forget(self, workload: str) -> None:
        for wv in [k for k in self._book if k[0] == workload]:
            del self._book[wv]
        for wvc in [k for k in self._classes if k[0] == workload]:
            del self._classes[wvc]

    def forget_device(self, device_id: str) -> None:
        """A removed device: a re-enrolled one starts untainted (its records go with its workloads)."""
        self._refuted.discard(device_id)
