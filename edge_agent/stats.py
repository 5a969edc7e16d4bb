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

    On a busy link publishes queue behind each other on the one connection,
    so an ack time includes the wait behind earlier frames; ``complete``
    (acks of one connection, in send order) measures a queued publish from
    the previous ack instead.
    """

    __slots__ = ("_bw", "_last_ack", "_rtt", "large_bytes")

    def __init__(self, large_bytes: int = 64 * 1024, window: int = 16) -> None:
        self.large_bytes = large_bytes
        self._rtt: deque[float] = deque(maxlen=window)
        self._bw: deque[float] = deque(maxlen=window)
        self._last_ack: float | None = None

    def complete(self, nbytes: int, sent_at: float, acked_at: float) -> None:
        """One publish acked; call in send order with its (monotonic) send and ack times.

        Acks of one connection come in order. A publish sent before the previous
        one was acked queued behind it: its bytes went on the wire as the earlier
        bytes drained, so its transfer time is ``acked_at`` minus the previous ack
        (no RTT subtracted: it was flowing while that ack came back), capped at
        its own unqueued time; a small queued publish gives no RTT sample. An
        unqueued publish is measured as ``observe`` does.
        """
        prev = self._last_ack
        self._last_ack = acked_at if prev is None else max(prev, acked_at)
        if prev is None or sent_at >= prev:
            self.observe(nbytes, acked_at - sent_at)
            return
        if nbytes < self.large_bytes:
            return
        transfer = acked_at - prev
        rtt = self.rtt_s
        if rtt is not None and acked_at - sent_at - rtt > 0:
            transfer = min(transfer, acked_at - sent_at - rtt)
        if transfer > 0:  # acks seen in one poll share a time: no sample
            self._bw.append(8.0 * nbytes / transfer)

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
