"""A site's WAN link to the coordinator in simulated time: up or cut, and the summaries that wait.

A fog keeps running its site when the WAN goes (its registry, scheduler and
controller are local); what it cannot do is report. Summaries sent while the
link is cut stay in the site's outbox (bounded: the oldest go first) and are
delivered, in order, when it is restored. Pure: time is a parameter.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

__all__ = ["Cut", "SiteSummary", "WanLink"]


@dataclass(frozen=True, slots=True)
class SiteSummary:
    """What a fog tells the coordinator about its site every summary interval."""

    site: str
    at_s: float
    devices_alive: int
    workloads: int
    workloads_running: int
    repairs: int


@dataclass(slots=True)
class Cut:
    """One outage of the link; ``restored_at`` is None while it lasts."""

    cut_at: float
    restored_at: float | None = None
    queued: int = 0
    drained: int = 0
    repairs_before: int = 0   # the site's repair count when the link went ...
    repairs_after: int = 0    # ... and when it came back (repairs made while cut = the difference)


@dataclass(slots=True)
class WanLink:
    site: str
    max_queued: int = 10_000
    up: bool = True
    outbox: deque[SiteSummary] = field(default_factory=deque)
    sent: int = 0
    delivered: int = 0
    queued: int = 0
    drained: int = 0
    dropped: int = 0        # queued summaries lost to the outbox bound
    cuts: list[Cut] = field(default_factory=list)

    def cut(self, now: float, repairs: int) -> bool:
        """Take the link down; False when it was down already."""
        if not self.up:
            return False
        self.up = False
        self.cuts.append(Cut(now, repairs_before=repairs))
        return True

    def restore(self, now: float, repairs: int) -> list[SiteSummary]:
        """Bring the link up; the summaries that waited, oldest first (now delivered)."""
        if self.up:
            return []
        self.up = True
        out = list(self.outbox)
        self.outbox.clear()
        self.drained += len(out)
        self.delivered += len(out)
        c = self.cuts[-1]
        c.restored_at, c.drained, c.repairs_after = now, len(out), repairs
        return out

    def send(self, summary: SiteSummary) -> bool:
        """True when delivered now; False when it waits in the outbox for the link to come back."""
        self.sent += 1
        if self.up:
            self.delivered += 1
            return True
        if self.max_queued <= 0:
            self.dropped += 1
            return False
        if len(self.outbox) >= self.max_queued:
            self.outbox.popleft()
            self.dropped += 1
        self.outbox.append(summary)
        self.queued += 1
        self.cuts[-1].queued += 1
        return False
