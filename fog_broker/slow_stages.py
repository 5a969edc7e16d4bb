"""Stages that no longer meet the plan: measured stage times against planned ones (pure).

A device that throttles mid-stream (heat, a governor, a neighbour's load) need not say so: its
``throttled`` flag covers only what ``vcgencmd`` or a thermal zone reports. What it cannot hide is
the p50 compute time its state adverts report for each partition it runs. This rule compares that
time with the plan's (the workload's measured segment times for the device, else the partition's
own calibration at load) and sets the device aside when a stage stays slow:

* slow: measured p50 > ``factor`` x planned and at least ``min_excess_s`` over it, in ``sustain``
  consecutive adverts that each served new requests (a window that did not move says nothing new;
  a 0.2 ms stage at 0.6 ms on a busy core costs nothing worth a move);
* healthy: measured <= ``recover`` x planned resets the streak; between the two nothing changes
  (the hysteresis band: a p50 hovering around one threshold cannot flap);
* a set-aside device takes no partition for ``hold_s`` (the scheduler sees it as throttled, so
  what it runs is re-placed), doubled each time it is set aside again up to ``max_hold_s``
  (CrashLoopBackOff's rule: a device that is slow whenever it works stops getting work back every
  minute); ``sustain`` healthy adverts after a release forgive its strikes.

No clock, no I/O: ``SiteCore`` feeds it each state and ticks it.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from runtime.errors import LocalViolation

__all__ = ["SlowStageConfig", "StageSample", "SetAside", "SlowStages", "planned_stage_s"]

Key = tuple[str, int, int, int]  # workload, version, replica, index (the controller's PartKey)


@dataclass(frozen=True, slots=True)
class SlowStageConfig:
    factor: float = 2.0       # slow: measured p50 above this many times the plan
    recover: float = 1.25     # healthy: at most this many times the plan (factor > recover: hysteresis)
    sustain: int = 3          # consecutive slow adverts (each with new requests) before the stage moves
    hold_s: float = 60.0      # a set-aside device takes no partition this long, doubled per strike
    max_hold_s: float = 960.0
    min_excess_s: float = 0.01  # and slower than the plan by at least this much

    def __post_init__(self) -> None:
        if not (math.isfinite(self.factor) and self.factor > self.recover >= 1.0):
            raise LocalViolation("slow stages: need factor > recover >= 1")
        if self.sustain < 1 or not 0.0 < self.hold_s <= self.max_hold_s or not math.isfinite(self.max_hold_s):
            raise LocalViolation("slow stages: need sustain >= 1 and 0 < hold_s <= max_hold_s (finite)")
        if not 0.0 <= self.min_excess_s < math.inf:
            raise LocalViolation("slow stages: need min_excess_s >= 0")


@dataclass(frozen=True, slots=True)
class StageSample:
    """One partition in one state advert: requests served so far, its p50, the plan's time."""
    key: Key
    served: int
    measured_s: float
    planned_s: float


@dataclass(frozen=True, slots=True)
class SetAside:
    """The device takes no partition until ``until``: what it runs is re-placed."""
    device: str
    key: Key
    reason: str
    until: float


@dataclass(slots=True)
class _Track:
    served: int
    streak: int = 0


@dataclass(slots=True)
class _Device:
    tracks: dict[Key, _Track] = field(default_factory=dict)
    strikes: int = 0
    healthy: int = 0             # healthy adverts in a row since the last release (forgives strikes)
    until: float = -math.inf     # set aside until then
    reason: str = ""


def planned_stage_s(segment_times: Mapping[str, Sequence[float]], device_id: str,
                    first: int, last: int, calib_s: float) -> float:
    """The plan's compute time of segments ``first..last`` on a device: the measured segment times of
    that device (keyed by its id), else the partition's own calibration; 0.0 when neither is known
    (FLOPs over a claimed peak are no yardstick for a real board). Never its class's times: a device
    is judged by its own measurements, so no other device's (true or false) figures set it aside."""
    times = segment_times.get(device_id)
    if times is not None and 0 <= first <= last < len(times):
        planned = float(sum(times[first:last + 1]))
        if planned > 0.0:
            return planned
    return calib_s if calib_s > 0.0 and math.isfinite(calib_s) else 0.0


class SlowStages:
    """Per device: a streak per stage, strikes, and whether it is set aside (and why)."""

    def __init__(self, config: SlowStageConfig | None = None) -> None:
        self.config = config or SlowStageConfig()
        self._devices: dict[str, _Device] = {}

    @property
    def set_aside(self) -> dict[str, str]:
        """Devices set aside now -> why (for status and for the fleet the scheduler sees)."""
        return {d: s.reason for d, s in self._devices.items() if s.until > -math.inf}

    def reason_of(self, device: str) -> str | None:
        """Why ``device`` is set aside now, or None."""
        d = self._devices.get(device)
        return d.reason if d is not None and d.until > -math.inf else None

    def observe(self, device: str, stages: Sequence[StageSample], now: float) -> SetAside | None:
        """A device's state: its partitions' samples. The worst slow stage when the device is set aside."""
        c = self.config
        if not stages and device not in self._devices:
            return None  # runs nothing, never slow: no record (a site of idle devices stays small)
        dev = self._devices.setdefault(device, _Device())
        seen = {s.key for s in stages}
        for k in [k for k in dev.tracks if k not in seen]:  # undeployed: bounded by what it runs
            del dev.tracks[k]
        worst: tuple[float, StageSample] | None = None
        moved = False
        for s in stages:
            tr = dev.tracks.get(s.key)
            if tr is None or s.served < tr.served:  # new, or deployed again: a fresh window
                dev.tracks[s.key] = _Track(s.served)
                continue
            if s.served == tr.served or not (s.planned_s > 0.0 and s.measured_s > 0.0):
                continue  # no new requests, or no yardstick: nothing learned
            tr.served = s.served
            moved = True
            ratio = s.measured_s / s.planned_s
            if ratio > c.factor and s.measured_s - s.planned_s >= c.min_excess_s:
                tr.streak += 1
                if tr.streak >= c.sustain and (worst is None or ratio > worst[0]):
                    worst = (ratio, s)
            elif ratio <= c.recover:
                tr.streak = 0
        if dev.until > -math.inf:
            return None  # already set aside: its stages are moving
        if worst is None:
            if moved and all(t.streak == 0 for t in dev.tracks.values()):
                dev.healthy += 1
                if dev.healthy >= c.sustain:
                    dev.strikes = 0
            return None
        ratio, s = worst
        dev.strikes += 1
        dev.healthy = 0
        hold = min(c.hold_s * 2.0 ** (dev.strikes - 1), c.max_hold_s)
        dev.until = now + hold
        for tr in dev.tracks.values():
            tr.streak = 0
        w, v, r, i = s.key
        dev.reason = (f"{w} v{v} replica {r} stage {i}: measured p50 {s.measured_s * 1000:.1f} ms, "
                      f"{ratio:.1f}x the plan's {s.planned_s * 1000:.1f} ms in {c.sustain} adverts; "
                      f"set aside {hold:.0f} s")
        return SetAside(device, s.key, dev.reason, dev.until)

    def tick(self, now: float) -> list[str]:
        """Devices whose hold ended: they may take partitions again."""
        out = []
        for d, s in self._devices.items():
            if -math.inf < s.until <= now:
                s.until, s.reason, s.healthy = -math.inf, "", 0
                s.tracks.clear()
                out.append(d)
        return sorted(out)

    def next_deadline(self) -> float:
        return min((s.until for s in self._devices.values() if s.until > -math.inf), default=math.inf)

    def forget(self, device: str) -> None:
        """A removed device: nothing of it is kept (a lost one keeps its strikes, not its windows)."""
        self._devices.pop(device, None)

    def lost(self, device: str) -> None:
        dev = self._devices.get(device)
        if dev is not None:
            dev.tracks.clear()
