"""A device's calibration claims against the times the router saw (pure).

An agent reports how long its partitions take (``calib_s`` at load, ``p50_s`` once serving);
both are its own words. A device reporting 50 µs for a stage that takes 50 ms would win
placement, make its class look fast and sit below the floor that triggers a measurement. The
router times every answer it gets (sent to answered, minus the queueing it predicted), so for a
chain that runs on one device the fog holds a measurement the device cannot shape: the round
trip is at least that device's compute. When the fastest round trip of the last ``span_s``
(in ``samples`` periods, each of which must have answers, so a passing stall of the fog or the
host refutes no one, however many requests it slowed) is
more than ``factor`` times what the device claims, more than ``slack_s`` above it, and its
unexplained rest more than ``peer_factor`` times the median rest of the site's other one-device
chains (network, codec and a busy host slow every chain alike; a lie slows only its own; with
no such chain, more than ``alone_s``), the claim is refuted: the device is flagged (no first replica), the
observed time becomes its measured time, and nothing it says about its speed is trusted again
until it is forgotten. A chain over several devices is never attributed to one of them: an
honest device is never flagged for a neighbour's claim.

No clock, no I/O: ``SiteCore`` feeds it the router's observations.
"""
from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from runtime.errors import LocalViolation

__all__ = ["ClaimCheck", "ClaimCheckConfig", "Refuted"]

_MAX_CHAINS = 20_000  # chains observed (bounded whatever the site holds)


@dataclass(frozen=True, slots=True)
class ClaimCheckConfig:
    factor: float = 4.0     # refuted: the fastest observed round trip above this many times the claim
    slack_s: float = 0.05   # and above it by at least this much (network, codec, a busy host)
    samples: int = 20       # periods of span_s / samples, each keeping its fastest answer: all before a verdict
    peer_factor: float = 4.0  # and its unexplained rest above this many times its peers' median rest
    alone_s: float = 0.5    # with no peers to compare with, the rest must pass this (a busy host alone)
    span_s: float = 30.0    # and the samples must span this long: a passing stall (a flood at the fog,
    #                         a loaded host) that slows every answer for a while refutes no one

    def __post_init__(self) -> None:
        if not (math.isfinite(self.factor) and self.factor > 1.0 and 0.0 <= self.slack_s < math.inf
                and self.samples >= 1 and math.isfinite(self.peer_factor) and self.peer_factor >= 1.0
                and self.slack_s <= self.alone_s < math.inf and 0.0 <= self.span_s < math.inf):
            raise LocalViolation("claim check: need factor > 1, peer_factor >= 1, 0 <= slack_s <= alone_s "
                                 "(finite), samples >= 1, span_s >= 0")


@dataclass(frozen=True, slots=True)
class Refuted:
    """``device`` claimed ``claimed_s`` for a chain the router saw take at least ``observed_s``."""
    device: str
    workload: str
    version: int
    replica: int
    claimed_s: float
    observed_s: float

    @property
    def reason(self) -> str:
        return (f"claimed {self.claimed_s * 1000:.2f} ms for {self.workload} v{self.version} replica "
                f"{self.replica}; the router observed at least {self.observed_s * 1000:.1f} ms "
                f"({self.observed_s / max(self.claimed_s, 1e-9):.0f}x): its timings are not trusted")


class ClaimCheck:
    """Per single-device chain: the last few observed round trips; per device: whether it was refuted."""

    def __init__(self, config: ClaimCheckConfig | None = None) -> None:
        self.config = config or ClaimCheckConfig()
        # per chain: the last ``samples`` periods, [start, fastest round trip in it]
        self._seen: dict[tuple[str, int, int], deque[list[float]]] = {}
        self._rest: dict[tuple[str, int, int], float] = {}  # per chain: fastest round trip minus claims
        self.refuted: dict[str, Refuted] = {}

    def observe(self, workload: str, version: int, replica: int, devices: Sequence[str], seconds: float,
                claimed: Sequence[float] | None, at: float) -> Refuted | None:
        """One answered request at ``at`` (monotonic): ``devices`` of its route, its round trip beyond
        predicted queueing, the stage times its devices claim (None: not all known). A new refutation, or None."""
        c = self.config
        if not devices or len(set(devices)) != 1 or not (seconds > 0 and math.isfinite(seconds)):
            return None  # several devices: not attributable to one
        device = devices[0]
        if device in self.refuted or claimed is None:
            return None
        key = (workload, version, replica)
        seen = self._seen.get(key)
        if seen is None:
            if len(self._seen) >= _MAX_CHAINS:
                self._rest.pop(old := next(iter(self._seen)), None)
                self._seen.pop(old)
            seen = self._seen[key] = deque(maxlen=c.samples)
        if seen and at - seen[-1][0] < c.span_s / c.samples:
            seen[-1][1] = min(seen[-1][1], seconds)  # same period: only its fastest answer counts
        else:
            seen.append([at, seconds])
        total = float(sum(claimed))
        if len(seen) < c.samples or not (total >= 0 and math.isfinite(total)):
            return None  # fewer periods than samples: less than span_s observed
        fastest = min(s for _, s in seen)
        rest = self._rest[key] = fastest - total
        if fastest <= c.factor * total or rest < c.slack_s:
            return None
        peers = sorted(r for k, r in self._rest.items() if k != key)
        if peers and rest <= c.peer_factor * max(peers[len(peers) // 2], 0.0):
            return None  # every chain is that slow beyond its claims: the host or network, not a lie
        if not peers and rest < c.alone_s:
            return None  # nothing to compare with: only a gross lie is told from a busy host
        verdict = Refuted(device, workload, version, replica, total, fastest)
        self.refuted[device] = verdict
        return verdict

    def is_refuted(self, device: str) -> bool:
        return device in self.refuted

    def forget_workload(self, workload: str) -> None:
        for k in [k for k in self._seen if k[0] == workload]:
            del self._seen[k]
            self._rest.pop(k, None)

    def forget(self, device: str) -> None:
        """A removed device (revoked, re-enrolled): its refutation goes with it."""
        self.refuted.pop(device, None)
