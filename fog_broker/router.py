"""Inference router bookkeeping (pure): pending requests, attempts, deadlines, failover.

The shell hands it a request together with the healthy replica chains of the
workload (primary first) and the clocks; the router answers with commands:
send an ``Activation`` to the first hop, or reply to the client. Every accepted
request ends in exactly one ``ReplyClient`` (a result or an error): on an error
or a timeout it retries once on another chain, then answers with the error.
"""
from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from runtime.messages import Activation, Hop, InferenceRequest, InferenceResult

__all__ = ["RouterConfig", "Router", "SendActivation", "ReplyClient", "Command", "Chain", "LatencyHistogram",
           "LATENCY_BUCKETS_S"]

Chain = tuple[int, tuple[Hop, ...]]  # (replica, route)


def _chain_id(chain: Chain) -> tuple[int, int]:
    """(replica, version): during a version switch an old and a new chain may share a replica index,
    and a request that failed on the old one (retired and undeployed) must still fail over to the new."""
    return chain[0], chain[1][0].version if chain[1] else -1


# Upper bounds (s) of the latency buckets: 1 ms (one hop on a LAN) to 30 s (a long chain on slow devices).
LATENCY_BUCKETS_S: tuple[float, ...] = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                                        2.5, 5.0, 10.0, 30.0)
MAX_HISTOGRAMS = 1000  # workloads with a latency histogram; beyond this, new names share one


@dataclass(slots=True)
class LatencyHistogram:
    """Answered requests of one workload since the fog started: counts per bucket, their sum (pure).

    ``counts[i]`` counts latencies ``<= bounds[i]`` and above the previous bound; the last entry
    counts those above every bound. Read by ``fog_broker.metrics`` at scrape time.
    """

    bounds: tuple[float, ...] = LATENCY_BUCKETS_S
    counts: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS_S) + 1))
    total_s: float = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, seconds)] += 1
        self.total_s += seconds


@dataclass(frozen=True, slots=True)
class RouterConfig:
    max_attempts: int = 2            # the first chain, then one other
    max_pending: int = 10_000        # beyond this, new requests are refused at once
    default_timeout_s: float = 5.0
    max_timeout_s: float = 120.0


@dataclass(frozen=True, slots=True)
class SendActivation:
    device: str
    activation: Activation


@dataclass(frozen=True, slots=True)
class ReplyClient:
    reply_to: str
    result: InferenceResult


Command = SendActivation | ReplyClient


@dataclass(slots=True)
class _Pending:
    request: InferenceRequest
    received_at: float
    deadline: float           # overall, monotonic
    attempt_deadline: float
    attempt: int
    chain: Chain
    tried: set[tuple[int, int]] = field(default_factory=set)  # chain ids (``_chain_id``)
    errors: list[str] = field(default_factory=list)


class Router:
    """Pending inference requests of one fog broker; one owner thread drives it."""

    def __init__(self, reply_topic: str, config: RouterConfig | None = None) -> None:
        self.reply_topic = reply_topic
        self.config = config or RouterConfig()
        self._pending: dict[str, _Pending] = {}   # attempt id -> pending
        self._by_request: dict[str, str] = {}     # client request id -> attempt id
        self.counters: dict[str, int] = {"accepted": 0, "answered": 0, "failed": 0, "retries": 0,
                                          "timeouts": 0, "late": 0, "refused": 0}
        self.latencies: deque[float] = deque(maxlen=10_000)  # answered requests, receive -> answer (s)
        self.latency_by_workload: dict[str, deque[float]] = {}
        self.latency_histograms: dict[str, LatencyHistogram] = {}  # workload -> all its answered requests
        # (workload, version, replica) -> each partition's output wire (``runtime.activations``),
        # set once the fog chose them; routes of chains not here carry float32.
        self.wires: dict[tuple[str, int, int], tuple[str, ...]] = {}
        self.wire_reports: dict[tuple[str, int, int], dict[str, object]] = {}
        self._answered_at: dict[str, deque[float]] = {}  # workload -> last answers (monotonic)

    def __len__(self) -> int:
        return len(self._pending)

    def submit(self, req: InferenceRequest, chains: Sequence[Chain], now: float, wall: float,
               why_none: str = "") -> list[Command]:
        """Accept a request and route it on the first chain, or answer at once with an error."""
        if req.request_id in self._by_request:
            return []  # a QoS1 duplicate of a request in flight
        if len(self._pending) >= self.config.max_pending:
            self.counters["refused"] += 1
            return [self._error(req, f"router overloaded ({len(self._pending)} requests pending)", "overloaded")]
        if not chains:
            self.counters["refused"] += 1
            return [self._error(req, f"workload '{req.workload}' has no running replica"
                                     + (f": {why_none}" if why_none else ""),
                                "unknown" if why_none == "unknown workload" else "not ready")]
        timeout = req.timeout_s if req.timeout_s > 0 else self.config.default_timeout_s
        timeout = min(timeout, self.config.max_timeout_s)
        self.counters["accepted"] += 1
        p = _Pending(req, now, now + timeout, 0.0, 0, chains[0])
        return self._send(p, chains, now, wall)

    def result(self, res: InferenceResult, chains: Sequence[Chain], now: float, wall: float,
               sender: str | None = None) -> list[Command]:
        """A result (or a hop's error) came back for one of our attempts.

        ``sender`` is the authenticated device that sealed it: only a device of the attempt's
        route may answer for it (a result is the last hop's, an error any hop's).
        """
        p = self._pending.get(res.request_id)
        if p is None:
            self.counters["late"] += 1
            return []
        if sender is not None:
            route = p.chain[1]
            allowed = {route[-1].device_id} if res.ok else {h.device_id for h in route}
            if sender not in allowed:
                self.counters["wrong sender"] = self.counters.get("wrong sender", 0) + 1
                return []
        del self._pending[res.request_id]
        del self._by_request[p.request.request_id]
        if res.ok:
            self.counters["answered"] += 1
            self.latencies.append(now - p.received_at)
            self.latency_by_workload.setdefault(p.request.workload, deque(maxlen=500)).append(now - p.received_at)
            self._observe(p.request.workload, now - p.received_at)
            if len(self._answered_at) < MAX_HISTOGRAMS or p.request.workload in self._answered_at:
                self._answered_at.setdefault(p.request.workload, deque(maxlen=256)).append(now)
            return [ReplyClient(p.request.reply_to, InferenceResult(
                p.request.request_id, True, dict(res.tensors), "", res.device_id, p.chain[0],
                now - p.received_at))]
        p.errors.append(f"replica {p.chain[0]}: {res.error or 'error'}"
                        + (f" (at {res.device_id})" if res.device_id else ""))
        return self._retry(p, chains, now, wall)

    def device_lost(self, device_id: str, chains_of: dict[str, Sequence[Chain]], now: float,
                    wall: float) -> list[Command]:
        """Requests in flight through a lost device fail over now instead of at their timeout."""
        out: list[Command] = []
        for aid, p in list(self._pending.items()):
            if any(h.device_id == device_id for h in p.chain[1]):
                del self._pending[aid]
                del self._by_request[p.request.request_id]
                p.errors.append(f"replica {p.chain[0]}: device {device_id} lost")
                out.extend(self._retry(p, chains_of.get(p.request.workload, ()), now, wall))
        return out

    def tick(self, now: float, chains_of: dict[str, Sequence[Chain]], wall: float) -> list[Command]:
        out: list[Command] = []
        for aid, p in list(self._pending.items()):
            if now >= p.attempt_deadline:
                del self._pending[aid]
                del self._by_request[p.request.request_id]
                self.counters["timeouts"] += 1
                p.errors.append(f"replica {p.chain[0]}: timed out")
                out.extend(self._retry(p, chains_of.get(p.request.workload, ()), now, wall))
        return out

    def measured_p50(self, workload: str) -> float | None:
        """Median receive -> answer time of the workload's last answered requests (None: none yet)."""
        xs = sorted(self.latency_by_workload.get(workload, ()))
        return xs[len(xs) // 2] if xs else None

    def measured_fps(self, workload: str, now: float, window_s: float = 10.0) -> float | None:
        """Answers per second of the workload over its last answers within ``window_s`` of now."""
        ts = [t for t in self._answered_at.get(workload, ()) if now - t <= window_s]
        if len(ts) < 2 or ts[-1] <= ts[0]:
            return None
        return (len(ts) - 1) / (ts[-1] - ts[0])

    def set_wires(self, key: tuple[str, int, int], wires: tuple[str, ...],
                  report: dict[str, object]) -> None:
        """Route chain ``key`` = (workload, version, replica) with these per-partition wires."""
        self.wires[key] = wires
        self.wire_reports[key] = report
        if len(self.wires) > 4 * MAX_HISTOGRAMS:  # bounded: drop the oldest chain's entry
            old = next(iter(self.wires))
            self.wires.pop(old, None)
            self.wire_reports.pop(old, None)

    def workload_of(self, attempt_id: str) -> str:
        """The workload a pending attempt belongs to ('' when it is not pending any more)."""
        p = self._pending.get(attempt_id)
        return p.request.workload if p is not None else ""

    def workloads_in_flight(self) -> set[str]:
        return {p.request.workload for p in self._pending.values()}

    def next_deadline(self) -> float:
        return min((p.attempt_deadline for p in self._pending.values()), default=math.inf)

    # ------------------------------------------------------------ internals

    def _observe(self, workload: str, seconds: float) -> None:
        h = self.latency_histograms.get(workload)
        if h is None:
            if len(self.latency_histograms) >= MAX_HISTOGRAMS:
                workload = "(other)"  # a bounded number of series whatever clients name
            h = self.latency_histograms.setdefault(workload, LatencyHistogram())
        h.observe(seconds)

    def _retry(self, p: _Pending, chains: Sequence[Chain], now: float, wall: float) -> list[Command]:
        if p.attempt < self.config.max_attempts and now < p.deadline:
            fresh = [c for c in chains if _chain_id(c) not in p.tried]
            if fresh:
                self.counters["retries"] += 1
                return self._send(p, fresh, now, wall)
        self.counters["failed"] += 1
        timed_out = bool(p.errors) and all(e.endswith("timed out") for e in p.errors)
        return [self._error(p.request, "; ".join(p.errors), "timeout" if timed_out else "failed")]

    def _send(self, p: _Pending, chains: Sequence[Chain], now: float, wall: float) -> list[Command]:
        # ``wall`` is always the fog's wall clock: ``SiteCore`` supplies it, also for a loss heard
        # in an advert (from the offset its last tick saw).
        chain = chains[0]
        p.chain = chain
        p.attempt += 1
        p.tried.add(_chain_id(chain))
        remaining = p.deadline - now
        others = [c for c in chains[1:] if _chain_id(c) not in p.tried]
        # Leave half of the budget for the failover when another chain could take it.
        share = remaining / 2 if others and p.attempt < self.config.max_attempts else remaining
        p.attempt_deadline = now + share
        aid = f"{p.request.request_id}#{p.attempt}"
        self._pending[aid] = p
        self._by_request[p.request.request_id] = aid
        route = chain[1]
        wires = self.wires.get((p.request.workload, route[0].version, chain[0])) if route else None
        if wires:
            route = tuple(replace(h, wire=wires[h.index]) if h.index < len(wires) else h
                          for h in route)
        act = Activation(aid, p.request.workload, route, 0, self.reply_topic,
                         dict(p.request.tensors), wall + remaining)
        return [SendActivation(chain[1][0].device_id, act)]

    def _error(self, req: InferenceRequest, error: str, failure: str) -> ReplyClient:
        return ReplyClient(req.reply_to, InferenceResult(req.request_id, False, {}, error[:2000], failure=failure))
