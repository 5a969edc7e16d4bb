"""Small pure statistics: a latency window with p50/p99, and the link estimator."""
from __future__ import annotations

import math
from collections import deque

__all__ = ["LatencyWindow", "LinkEstimator", "percentile"]


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of an ascending list (0 for an empty one)."""
    if not sorted_values:
        return 0.0
    rank = max(0, min(len(sorted_values) - 1, math.ceil(q / 100.0 * len(sorted_values)) - 1))
    return sorted_values[rank]


class LatencyWindow:
    """The last ``size`` durations; p50/p99 over them (kubelet-style recent health)."""

    __slots__ = ("_values",)

    def __init__(self, size: int = 256) -> None:
        self._values: deque[float] = deque(maxlen=size)

    def add(self, seconds: float) -> None:
        if seconds == seconds and seconds >= 0:  # drop NaN / negative
            self._values.append(seconds)

    def __len__(self) -> int:
        return len(self._values)

    def p(self, q: float) -> float:
        return percentile(sorted(self._values), q)


class LinkEstimator:
    """Passive uplink and RTT estimates from the time the broker takes to ack QoS1 publishes.

    A small publish's ack time is one round trip to the broker; a large one
    takes ``rtt + 8*bytes/bandwidth``. The RTT is the median of recent small
    samples; the bandwidth the median of recent large samples after
    subtracting that RTT. Medians, not means: one stalled ack (GC pause,
    retransmission) must not halve the estimate.
    """

    __slots__ = ("_bw", "_rtt", "large_bytes")

    def __init__(self, large_bytes: int = 64 * 1024, window: int = 16) -> None:
        self.large_bytes = large_bytes
        self._rtt: deque[float] = deque(maxlen=window)
        self._bw: deque[float] = deque(maxlen=window)

    def observe(self, nbytes: int, elapsed_s: float) -> None:
        if not (elapsed_s > 0 and nbytes >= 0):
            return
        if nbytes < self.large_bytes:
            self._rtt.append(elapsed_s)
            return
        rtt = self.rtt_s or 0.0
        transfer = elapsed_s - rtt if elapsed_s - rtt > elapsed_s * 0.1 else elapsed_s * 0.1
        self._bw.append(8.0 * nbytes / transfer)

    @property
    def rtt_s(self) -> float | None:
        return percentile(sorted(self._rtt), 50) if self._rtt else None

    @property
    def uplink_bps(self) -> float | None:
        return percentile(sorted(self._bw), 50) if self._bw else None
