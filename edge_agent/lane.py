"""The data lane: a byte budget on data-plane publishes, so control messages never queue long.

Everything an agent publishes shares one MQTT connection, a FIFO. On a slow uplink a full
pipeline's activations and results would queue seconds of bytes ahead of the next STATE
advert, and the fog declares a device lost after three missed adverts (issue 21). So a
data-plane publish waits, in the executor's thread, while the data bytes handed to MQTT
and not yet acked reach about half a second of the uplink: control publishes (STATE,
BIRTH, ACK) never wait and so find at most that much data (plus one frame) ahead of them.
One frame over the mark, not one under it: two frames of half the budget keep the link
busy while the first one's ack comes back.

The wait is bounded (a lost connection must never wedge the executor: after ``max_wait_s``
the publish goes anyway and is counted), one frame always goes when nothing is in flight
(a frame larger than the budget is not starved), small publishes (error replies, made on
the MQTT worker thread too) never wait, and a reconnect forgets the bytes of the old
connection (``reset``) so their acks, which may never come, cannot hold the lane.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["DataLane", "LaneTicket", "lane_budget"]

LANE_MIN_BYTES = 256 * 1024   # the floor: a LAN's bandwidth-delay product, and before any estimate
LANE_SECONDS = 0.5            # data allowed ahead of a control message, in seconds of uplink
LANE_MAX_WAIT_S = 2.0         # then publish anyway (counted as a timeout)
LANE_SMALL_BYTES = 8 * 1024   # no wait at or below this: cannot delay a STATE advert noticeably


def lane_budget(uplink_bps: float | None) -> int:
    """Bytes of data allowed in flight: ``LANE_SECONDS`` of the uplink, at least the floor."""
    if not uplink_bps or uplink_bps <= 0:
        return LANE_MIN_BYTES
    return max(LANE_MIN_BYTES, int(LANE_SECONDS * uplink_bps / 8))


@dataclass(frozen=True, slots=True)
class LaneTicket:
    """Bytes admitted to the lane; ``generation`` ties them to one connection (see ``reset``)."""

    nbytes: int
    generation: int


class DataLane:
    """Admits data-plane publishes against a byte budget; releases them on ack or give-up.

    ``budget`` is read at each admission (it follows the uplink estimate); ``clock`` and
    ``cond`` are injectable for tests.
    """

    def __init__(self, budget: Callable[[], int], *, max_wait_s: float = LANE_MAX_WAIT_S,
                 small_bytes: int = LANE_SMALL_BYTES, clock: Callable[[], float] = time.monotonic,
                 cond: threading.Condition | None = None) -> None:
        self._budget = budget
        self.max_wait_s = max_wait_s
        self.small_bytes = small_bytes
        self._clock = clock
        self._cond = cond if cond is not None else threading.Condition()
        self._in_flight = 0
        self._generation = 0
        self._closed = False
        self.waits = 0        # publishes that had to wait for room
        self.timeouts = 0     # ... and went anyway after max_wait_s
        self.wait_s = 0.0     # total time spent waiting
        self.given_up = 0     # releases of publishes never acked (the ack watcher gave up)
        self.resets = 0       # reconnects (bytes of the old connection forgotten)

    def _fits(self) -> bool:
        return self._closed or self._in_flight == 0 or self._in_flight < self._budget()

    def acquire(self, nbytes: int) -> LaneTicket:
        """Wait (at most ``max_wait_s``) while the budget is used up; count ``nbytes`` in flight."""
        with self._cond:
            if nbytes > self.small_bytes and not self._fits():
                self.waits += 1
                start = self._clock()
                deadline = start + self.max_wait_s
                while not self._fits():
                    left = deadline - self._clock()
                    if left <= 0:
                        self.timeouts += 1
                        break
                    self._cond.wait(left)
                self.wait_s += self._clock() - start
            self._in_flight += nbytes
            return LaneTicket(nbytes, self._generation)

    def release(self, ticket: LaneTicket, *, given_up: bool = False) -> None:
        """The publish was acked (or never will be: ``given_up``), or was not sent at all."""
        with self._cond:
            if given_up:
                self.given_up += 1
            if ticket.generation == self._generation:
                self._in_flight = max(0, self._in_flight - ticket.nbytes)
                self._cond.notify_all()

    def reset(self) -> None:
        """A (re)connect: what was in flight on the old connection no longer counts."""
        with self._cond:
            self._generation += 1
            self._in_flight = 0
            self.resets += 1
            self._cond.notify_all()

    def close(self) -> None:
        """Stopping: nobody waits any more."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def status(self) -> dict[str, Any]:
        with self._cond:
            return {"in_flight_bytes": self._in_flight, "budget_bytes": self._budget(),
                    "waits": self.waits, "timeouts": self.timeouts, "wait_s": round(self.wait_s, 3),
                    "given_up": self.given_up, "resets": self.resets}
