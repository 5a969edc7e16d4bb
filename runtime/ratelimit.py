"""Rate limits: a token bucket, fair shares per sender (``FairShare``), rate-limited log lines.

``RateLimit`` bounds one stream (rebirths, refusals, enrolment requests). ``FairShare`` gives
every sender its own budget per message kind, keyed by the id the sender's topic carries (the
broker's ACL lets only that identity write it): traffic past the budget is dropped and counted
(throttled), never held against the sender, so an honest device or app that is merely busy is
slowed, not shut out. Only inputs that fail their checks (a bad signature, a replayed copy, a
malformed frame, a payload signed by someone other than its topic's id: ``charge``) count
towards a quarantine, which no honest sender ever earns (docs/security.md, Flooding). The fog
and the agent both use it; ``LogLimit`` keeps a flood from becoming a flood of log lines.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["BULK", "LIVE", "OVER", "QUARANTINED", "Budget", "Copies", "FairShare", "LogLimit", "RateLimit",
           "SharePolicy"]


class RateLimit:
    """``rate`` tokens a second up to ``burst``; ``take(now)`` spends one if there is one.

    Pure: the caller passes its monotonic clock. Not thread-safe: one owner (or a lock around it).
    """

    def __init__(self, rate: float, burst: float) -> None:
        self.rate, self.burst = rate, burst
        self.level, self.at = burst, -math.inf

    def take(self, now: float) -> bool:
        if math.isfinite(self.at):
            self.level = min(self.burst, self.level + (now - self.at) * self.rate)
        self.at = now
        if self.level < 1.0:
            return False
        self.level -= 1.0
        return True


# ------------------------------------------------------------------ fair share per identity

LIVE = "live"              # within the sender's liveness share: handled ahead of bulk traffic
BULK = "bulk"              # over the liveness share, within the budget: handled after live traffic
OVER = "over budget"       # dropped: the sender's budget for this kind is spent
QUARANTINED = "quarantined"  # dropped: the sender flooded and is shut out for a while


@dataclass(frozen=True, slots=True)
class Budget:
    """``rate`` messages a second, ``burst`` at once."""

    rate: float
    burst: float

    def __post_init__(self) -> None:
        if not (self.rate > 0 and self.burst >= 1):
            raise ValueError(f"a budget needs rate > 0 and burst >= 1, got {self.rate}, {self.burst}")


@dataclass(frozen=True, slots=True)
class SharePolicy:
    """Budgets per message kind, and when a sender that keeps flooding is quarantined.

    ``limits``: kind -> the most a sender may send (over it: dropped, counted, nothing more); a kind
    not listed is not limited. ``live``: kind -> the share that keeps a sender alive (within it:
    ahead of the rest). A sender with ``quarantine_failures`` failed checks (``charge``) within
    ``window_s`` is shut out for ``quarantine_s``: a quarantine withholds its writes (liveness
    too), so it must follow only from what an honest sender never sends, never from its rate
    alone. Once a sender has ``suspect_failures`` failed checks in the window, its traffic over
    budget counts as failures too: only a few of a fast flood are checked at all, and an honest
    sender (a few QoS 1 duplicates after a reconnect at most) never gets there.
    """

    limits: Mapping[str, Budget]
    live: Mapping[str, Budget] = field(default_factory=dict)
    quarantine_failures: int = 50
    suspect_failures: int = 10
    window_s: float = 10.0
    quarantine_s: float = 60.0
    max_identities: int = 100_000


@dataclass(slots=True)
class _Sender:
    buckets: dict[str, list[float]]  # kind -> [tokens, live tokens, last refill]: both refill together
    dropped: int = 0            # over budget (throttled), this run
    failed: int = 0             # failed checks (``charge``), this run
    shut_out: int = 0           # dropped while quarantined, this run
    window_at: float = -math.inf
    window_fails: int = 0
    until: float = -math.inf    # quarantined until (monotonic)
    reason: str = ""


class FairShare:
    """Token buckets keyed by (identity, kind) and the quarantine rule: ``admit`` says what to do.

    Pure (the caller passes its monotonic clock) and bounded: one small record per identity the
    caller admits (callers pass only identities they know), at most ``max_identities`` of them.
    One thread calls ``admit``/``forget``; ``view`` may run on another (it copies before reading).
    """

    def __init__(self, policy: SharePolicy) -> None:
        self.policy = policy
        self._senders: dict[str, _Sender] = {}
        self._shut: dict[str, float] = {}  # identity -> quarantined until (only ever quarantined ones)
        self.quarantines = 0
        # kind -> (rate, burst, live rate, live burst); no live share: live tokens never run out
        self._rates = {kind: (b.rate, b.burst, *((lv.rate, lv.burst) if (lv := policy.live.get(kind)) else
                                                 (math.inf, math.inf)))
                       for kind, b in policy.limits.items()}

    def admit(self, identity: str, kind: str, now: float) -> str:
        """``LIVE``, ``BULK``, ``OVER`` or ``QUARANTINED`` for one message of ``kind`` from ``identity``."""
        s = self._senders.get(identity)
        if s is None:
            s = self._add(identity)
        if s.until > now:
            s.shut_out += 1
            return QUARANTINED
        r = self._rates.get(kind)
        if r is None:
            return LIVE
        b = s.buckets.get(kind)
        if b is None:
            b = s.buckets[kind] = [r[1], r[3], now]
        # inlined token buckets (this runs once per message on the MQTT worker, before anything else)
        dt = now - b[2] if now > b[2] else 0.0
        b[2] = now
        tokens = b[0] + dt * r[0]
        live = b[1] + dt * r[2]
        b[1] = live if live < r[3] else r[3]
        if tokens < 1.0:
            b[0] = tokens
            s.dropped += 1  # throttled only: a busy honest sender lands here too...
            if s.window_fails >= self.policy.suspect_failures:
                # ...unless its checked frames keep failing: then its excess is more of the same
                # (unchecked, so most of a fast flood), and counts towards its quarantine
                self._fail(identity, s, kind, now)
            return OVER
        b[0] = (tokens if tokens < r[1] else r[1]) - 1.0
        if b[1] < 1.0:
            return BULK
        b[1] -= 1.0
        return LIVE

    def charge(self, identity: str, kind: str, now: float) -> bool:
        """Count one message of ``kind`` that failed its check (a bad signature, a replayed copy, a
        malformed frame, a payload signed by someone other than its topic's id) against ``identity``;
        True if it is now quarantined. Never call it for what an honest sender may send (a clock
        outside the window, a session the fog lost): those ask for a rebirth instead."""
        s = self._senders.get(identity)
        if s is None:
            s = self._add(identity)
        s.failed += 1
        self._fail(identity, s, kind, now)
        return s.until > now

    def _fail(self, identity: str, s: _Sender, kind: str, now: float) -> None:
        p = self.policy
        if now - s.window_at >= p.window_s:
            s.window_at, s.window_fails = now, 0
        s.window_fails += 1
        if s.window_fails >= p.quarantine_failures and s.until <= now:
            s.until = now + p.quarantine_s
            s.reason = f"flooding: {s.window_fails} {kind} failed checks within {p.window_s:g} s"
            s.window_at, s.window_fails = -math.inf, 0
            self._shut[identity] = s.until
            self.quarantines += 1

    def _add(self, identity: str) -> _Sender:
        if len(self._senders) >= self.policy.max_identities:
            # a safety net only (callers pass known identities): forget the oldest not shut out
            for name, old in self._senders.items():
                if old.until == -math.inf:
                    del self._senders[name]
                    break
            else:
                self._senders.pop(next(iter(self._senders)))
        s = self._senders[identity] = _Sender({})
        return s

    def forget(self, identity: str) -> None:
        """An identity no longer trusted: its record goes (a new one starts from a full budget)."""
        self._senders.pop(identity, None)
        self._shut.pop(identity, None)

    def quarantined(self, identity: str, now: float) -> bool:
        s = self._senders.get(identity)
        return s is not None and s.until > now

    def shut_out(self, now: float) -> frozenset[str]:
        """The identities quarantined at ``now`` (any thread: a small dict, copied)."""
        for _ in range(5):
            try:
                return frozenset(n for n, until in list(self._shut.items()) if until > now)
            except RuntimeError:
                continue
        return frozenset()

    def reason(self, identity: str) -> str:
        s = self._senders.get(identity)
        return s.reason if s is not None else ""

    def view(self, now: float, top: int = 20) -> dict[str, Any]:
        """For ``fogline status``: who is quarantined and why, the ``top`` senders by drops (throttled
        or shut out) and by failed checks."""
        for _ in range(5):
            try:
                rows = list(self._senders.items())
                break
            except RuntimeError:  # the admitting thread added a sender meanwhile
                continue
        else:
            rows = []
        shut = {name: {"reason": s.reason, "remaining_s": round(s.until - now, 1),
                       "dropped": s.dropped + s.shut_out, "failed": s.failed}
                for name, s in rows if s.until > now}
        noisy = sorted(((s.dropped + s.shut_out, name) for name, s in rows if s.dropped or s.shut_out),
                       reverse=True)[:top]
        bad = sorted(((s.failed, name) for name, s in rows if s.failed), reverse=True)[:top]
        return {"quarantined": dict(sorted(shut.items())), "dropped": {name: n for n, name in noisy},
                "failed": {name: n for n, name in bad}, "quarantines": self.quarantines}


class LogLimit:
    """At most ``rate`` log lines a second (bursts of ``burst``) per key; the rest are counted.

    ``allow(key, now)`` says whether to log; ``suppressed(key)`` returns (and resets) how many
    were not, for the next line to say. Bounded: at most ``max_keys`` keys (then it starts over).
    """

    def __init__(self, rate: float = 1.0, burst: float = 5.0, max_keys: int = 1024) -> None:
        self.rate, self.burst, self.max_keys = rate, burst, max_keys
        self._buckets: dict[str, RateLimit] = {}
        self._held: dict[str, int] = {}

    def allow(self, key: str, now: float) -> bool:
        b = self._buckets.get(key)
        if b is None:
            if len(self._buckets) >= self.max_keys:
                self._buckets.clear()
                self._held.clear()
            b = self._buckets[key] = RateLimit(self.rate, self.burst)
        if b.take(now):
            return True
        self._held[key] = self._held.get(key, 0) + 1
        return False

    def suppressed(self, key: str) -> int:
        return self._held.pop(key, 0)


class Copies:
    """Signatures each sender sent lately: a second copy of a signed message is a replay, whatever its
    rate, so it is dropped (and charged to its sender) without a second signature check.

    Bounded: the last ``per_sender`` signatures of at most ``max_senders`` senders. One thread.
    """

    def __init__(self, per_sender: int = 1024, max_senders: int = 10_000) -> None:
        self.per_sender, self.max_senders = per_sender, max_senders
        self._seen: dict[str, dict[bytes, None]] = {}

    def seen(self, sender: str, signature: bytes) -> bool:
        """True if ``sender`` sent ``signature`` before (within memory); else remember it."""
        sigs = self._seen.get(sender)
        if sigs is None:
            if len(self._seen) >= self.max_senders:
                self._seen.pop(next(iter(self._seen)))
            sigs = self._seen[sender] = {}
        if signature in sigs:
            return True
        sigs[signature] = None
        if len(sigs) > self.per_sender:
            del sigs[next(iter(sigs))]
        return False

    def forget(self, sender: str) -> None:
        self._seen.pop(sender, None)
