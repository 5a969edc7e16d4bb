"""How many HTTP connections the fog keeps, from whom, and which to shed (pure: no sockets, no clock).

The HTTP API (``fog_broker.http_api``) asks ``ConnectionTable`` when a connection opens whom to
admit and whom to close, and tells it when a request starts and ends. A connection that is not
handling a request is *idle*: a keep-alive between requests, or a client still sending its
request head (slowloris). Idle ones are what a full table sheds, longest-idle first: from the same
peer when that peer is at its cap, else from the peer holding the most connections, so a flood
costs its sender its own connections first and a request in flight is never cut. Only when
nothing is idle is the new connection refused. Keys are opaque (the adapter's protocol objects);
``now`` is the caller's monotonic clock.
"""
from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Generic, TypeVar

from runtime.errors import LocalViolation

__all__ = ["HttpLimits", "ConnectionTable", "Admission"]

K = TypeVar("K", bound=Hashable)


@dataclass(frozen=True, slots=True)
class HttpLimits:
    """The HTTP API's budgets for slow or many clients (docs/http.md, "Limits")."""

    header_timeout_s: float = 10.0   # TLS handshake, and then a whole request head, within this
    body_timeout_s: float = 30.0     # a whole request body within this once its head arrived
    max_connections: int = 512       # open connections in total (after the TLS handshake)
    max_per_peer: int = 64           # ... from one IP address

    def __post_init__(self) -> None:
        if not (self.header_timeout_s > 0 and self.body_timeout_s > 0):
            raise LocalViolation("HTTP header and body timeouts must be > 0 s")
        if not 1 <= self.max_per_peer <= self.max_connections:
            raise LocalViolation("HTTP connection caps need 1 <= max_per_peer <= max_connections")


@dataclass(frozen=True, slots=True)
class Admission(Generic[K]):
    admit: bool
    close: tuple[K, ...] = ()   # connections to close now (shed to make room)
    reason: str = ""


@dataclass(slots=True)
class _Conn:
    peer: str
    busy: int = 0          # requests in progress (pipelining aside: 0 or 1)
    idle_since: float = 0.0


class ConnectionTable(Generic[K]):
    """Open connections by peer, with the admit/shed decision of the module docstring."""

    def __init__(self, max_connections: int, max_per_peer: int) -> None:
        self.max_connections = max_connections
        self.max_per_peer = max_per_peer
        self._conns: dict[K, _Conn] = {}
        self._by_peer: dict[str, dict[K, None]] = {}
        self.shed = 0
        self.refused = 0

    def __len__(self) -> int:
        return len(self._conns)

    def of_peer(self, peer: str) -> int:
        return len(self._by_peer.get(peer, ()))

    def open(self, key: K, peer: str, now: float) -> Admission[K]:
        """A connection from ``peer`` was accepted: admit it (maybe shedding idle ones) or refuse it."""
        close: list[K] = []
        if self.of_peer(peer) >= self.max_per_peer:
            victim = self._longest_idle(self._by_peer.get(peer, {}))
            if victim is None:
                self.refused += 1
                return Admission(False, (), f"{self.max_per_peer} connections from {peer} are all busy")
            close.append(victim)
            self._forget(victim)
        elif len(self._conns) >= self.max_connections:
            biggest = sorted(self._by_peer.values(), key=len, reverse=True)
            victim = next((v for group in biggest if (v := self._longest_idle(group)) is not None), None)
            if victim is None:
                self.refused += 1
                return Admission(False, (), f"{self.max_connections} connections are all busy")
            close.append(victim)
            self._forget(victim)
        self._conns[key] = _Conn(peer, 0, now)
        self._by_peer.setdefault(peer, {})[key] = None
        self.shed += len(close)
        return Admission(True, tuple(close))

    def busy(self, key: K) -> None:
        c = self._conns.get(key)
        if c is not None:
            c.busy += 1

    def idle(self, key: K, now: float) -> None:
        c = self._conns.get(key)
        if c is not None:
            c.busy = max(0, c.busy - 1)
            if c.busy == 0:
                c.idle_since = now

    def closed(self, key: K) -> None:
        self._forget(key)

    def _longest_idle(self, keys: dict[K, None]) -> K | None:
        best: K | None = None
        since = 0.0
        for k in keys:
            c = self._conns[k]
            if c.busy == 0 and (best is None or c.idle_since < since):
                best, since = k, c.idle_since
        return best

    def _forget(self, key: K) -> None:
        c = self._conns.pop(key, None)
        if c is None:
            return
        group = self._by_peer.get(c.peer)
        if group is not None:
            group.pop(key, None)
            if not group:
                del self._by_peer[c.peer]
