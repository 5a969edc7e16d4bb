"""How many replica chains a workload wants: a pure policy over the router's measured load.

Anchors: Kubernetes' HorizontalPodAutoscaler (desired = ceil(current x metric / target), a
scale-down stabilisation window that takes the largest recommendation seen in it) and Ray
Serve's upscale/downscale delays. The metric is *demand* utilisation: the offered rate
(admitted and refused alike: a refused request is load the site could not carry) times the
chains' bottleneck stage time, over the chains that serve. Utilisation of what was answered
alone saturates at 1.0 under overload and cannot say how many chains are missing.

A new replica chain of a split model is a gang of placements under memory, power-domain and
quota gates, so the policy only says what it wants and why; the controller adds a chain
through the scheduler (or says why it cannot) and drains one before it removes it.

Pure: time is a parameter, no I/O; one ``Autoscaler`` per site, driven by ``SiteCore.tick``.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

__all__ = ["AutoscaleConfig", "Load", "Decision", "Autoscaler", "desired_replicas", "replicas_for_rate"]


@dataclass(frozen=True, slots=True)
class AutoscaleConfig:
    interval_s: float = 1.0          # how often a decision is taken
    window_s: float = 5.0            # rates are measured over this window
    upscale_delay_s: float = 3.0     # the recommendation must stay above the current count this long
    downscale_delay_s: float = 30.0  # ... below it this long (longer: no flapping)
    #: scale down only when demand would fit the smaller count at this share of the target
    #: (hysteresis, HPA's 10 % tolerance: 0.7 target -> down only below 0.63 of the smaller count)
    downscale_margin: float = 0.9
    min_samples: int = 2             # decisions need this many measurements in the delay window


@dataclass(frozen=True, slots=True)
class Load:
    """One workload's measured load at one moment (from ``Router.stats``)."""

    offered_rps: float       # requests received per second (admitted or refused)
    shed_rps: float          # refused at admission
    goodput_rps: float       # answered within their deadline
    bottleneck_s: float      # the slowest stage's measured seconds per request (0: unmeasured)
    chains: int              # chains serving now
    outstanding: int         # requests in flight


@dataclass(frozen=True, slots=True)
class Decision:
    """A scale event: from ``current`` to ``replicas`` replica chains, and why."""

    workload: str
    current: int
    replicas: int
    reason: str


def desired_replicas(load: Load, target: float, *, margin: float = 1.0) -> float:
    """Chains needed to carry the offered load at ``target`` utilisation (fractional; inf unknown).

    ``margin`` < 1 asks for more head-room (used for scale-down hysteresis).
    """
    if load.bottleneck_s <= 0.0 or not math.isfinite(load.bottleneck_s):
        return math.nan
    demand = load.offered_rps * load.bottleneck_s  # chains' worth of busy time per second
    return demand / (target * margin)


def replicas_for_rate(rate_fps: float, bottleneck_s: float, target: float = 1.0) -> int:
    """Replica chains that serve ``rate_fps`` when each chain's slowest stage takes ``bottleneck_s``."""
    if bottleneck_s <= 0.0 or not math.isfinite(bottleneck_s) or rate_fps <= 0.0:
        return 1
    return max(1, math.ceil(rate_fps * bottleneck_s / target - 1e-9))


@dataclass(slots=True)
class _Track:
    samples: deque[tuple[float, float, float]] = field(default_factory=deque)  # (now, up, down) recs
    last_change: float = -math.inf


class Autoscaler:
    """Replica recommendations per workload with HPA-style stabilisation windows."""

    def __init__(self, config: AutoscaleConfig | None = None) -> None:
        self.config = config or AutoscaleConfig()
        self._tracks: dict[str, _Track] = {}
        self.events: deque[tuple[float, Decision]] = deque(maxlen=64)
        self.counts: dict[tuple[str, str], int] = {}  # (workload, "up" | "down") -> decisions

    def forget(self, workload: str) -> None:
        self._tracks.pop(workload, None)
        for k in [k for k in self.counts if k[0] == workload]:
            del self.counts[k]

    def decide(self, workload: str, load: Load, current: int, lo: int, hi: int, target: float,
               now: float, *, floor: int = 0) -> Decision | None:
        """The replica count ``workload`` should have now, if it should change (None: keep ``current``).

        ``lo``..``hi`` is the autoscale range; ``floor`` a count the workload's ``rate_fps`` needs
        (never scaled below it). Scaling up needs every sample of the last ``upscale_delay_s`` to
        ask for more; scaling down needs every sample of the last ``downscale_delay_s`` to fit in
        fewer with the hysteresis margin, and goes one chain at a time.
        """
        c = self.config
        lo_eff = max(lo, min(floor, hi))
        if current < lo_eff:
            return self._change(workload, current, lo_eff, now,
                                f"below its minimum: {current} -> {lo_eff} "
                                f"({'rate_fps' if lo_eff > lo else 'min_replicas'})")
        if current > hi:
            return self._change(workload, current, hi, now, f"above max_replicas: {current} -> {hi}")
        t = self._tracks.setdefault(workload, _Track())
        up = desired_replicas(load, target)
        # in fewer chains, the load must stay below target x margin: the count it would need then
        down = desired_replicas(load, target, margin=c.downscale_margin)
        if math.isnan(up):
            return None  # nothing measured yet: no opinion
        t.samples.append((now, up, down))
        horizon = max(c.upscale_delay_s, c.downscale_delay_s)
        while t.samples and t.samples[0][0] < now - horizon:
            t.samples.popleft()
        recent_up = [s for s in t.samples if s[0] >= now - c.upscale_delay_s]
        recent_down = [s for s in t.samples if s[0] >= now - c.downscale_delay_s]
        # up: the smallest recommendation of the window (every sample agrees on at least that)
        if len(recent_up) >= c.min_samples and t.samples[0][0] <= now - c.upscale_delay_s + c.interval_s:
            want_up = min(math.ceil(s[1] - 1e-9) for s in recent_up)
            if want_up > current and current < hi:
                n = min(hi, want_up)
                return self._change(workload, current, n, now,
                                    f"demand {load.offered_rps:.1f} req/s x {load.bottleneck_s * 1000:.0f} ms "
                                    f"needs {up:.2f} chains at {target:.0%} utilisation "
                                    f"for {c.upscale_delay_s:g} s: {current} -> {n}")
        # down: the largest recommendation of the (longer) window, with the margin, one chain at a time
        if current > lo_eff and len(recent_down) >= c.min_samples \
                and t.samples[0][0] <= now - c.downscale_delay_s + c.interval_s \
                and now - t.last_change >= c.downscale_delay_s:
            want_down = max(max(1, math.ceil(s[2] - 1e-9)) for s in recent_down)
            if want_down < current:
                n = max(lo_eff, current - 1)
                return self._change(workload, current, n, now,
                                    f"demand {load.offered_rps:.1f} req/s fits {n} chain(s) below "
                                    f"{target * c.downscale_margin:.0%} utilisation for "
                                    f"{c.downscale_delay_s:g} s: {current} -> {n}")
        return None

    def _change(self, workload: str, current: int, n: int, now: float, reason: str) -> Decision:
        t = self._tracks.setdefault(workload, _Track())
        t.last_change = now
        t.samples.clear()  # the new count changes what is measured: start the windows again
        d = Decision(workload, current, n, reason)
        self.events.append((now, d))
        key = (workload, "up" if n > current else "down")
        self.counts[key] = self.counts.get(key, 0) + 1
        return d
