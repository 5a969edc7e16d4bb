"""Inference router bookkeeping (pure): pending requests, attempts, deadlines, spreading, admission.

The shell hands it a request together with the healthy replica chains of the
workload and the clocks; the router answers with commands: send an
``Activation`` to the first hop, or reply to the client. Every accepted request
ends in exactly one ``ReplyClient`` (a result or an error).

* **Every replica serves.** A request goes to the chain that would finish it
  first: the outstanding work queued at each device of the route (each pending
  attempt's measured stage time at that device) plus the chain's own latency
  (its stage times and a learned per-chain overhead). Stage times come from the
  devices' state adverts (``note_stage``); before any is known, the chain with the
  fewest requests outstanding wins.
* **Admission against the deadline.** Each request carries a deadline (its own
  ``timeout_s``, else the workload's ``slo_s``, else ``default_timeout_s``). A
  request no chain is predicted to finish in time is refused at once
  (``failure="overloaded"``, with ``retry_after_s``), not queued until it times
  out; a hard bound (``max_outstanding`` per chain, ``max_pending`` in all) holds
  when nothing is measured yet. Expired work is never sent.
* **Failover.** After an error, a lost device or an attempt's own timeout, a
  request is retried once on another chain, only when that chain is predicted
  to finish it within its deadline; otherwise an attempt that may still make it
  keeps its chain until the deadline.
* **Ordered streams.** Requests naming a ``stream`` are answered in the order
  they were accepted (a reorder buffer per client and stream); a refusal at
  admission is immediate (it never entered the stream).

``RouterConfig(spread=False, admit=False)`` is the router before issue 32
(primary chain only, half the budget per attempt, no admission): the serving
benchmark's baseline.
"""
from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from runtime.messages import Activation, InferenceRequest, InferenceResult

from .router_model import Chain, CompletionModel, StageKey

__all__ = ["RouterConfig", "Router", "SendActivation", "ReplyClient", "Command", "Chain", "LatencyHistogram",
           "LATENCY_BUCKETS_S", "WorkloadStats"]


def _chain_id(chain: Chain) -> tuple[int, int]:
    """(replica, version): during a version switch an old and a new chain may share a replica index,
    and a request that failed on the old one (retired and undeployed) must still fail over to the new."""
    return chain[0], chain[1][0].version if chain[1] else -1


# Upper bounds (s) of the latency buckets: 1 ms (one hop on a LAN) to 30 s (a long chain on slow devices).
LATENCY_BUCKETS_S: tuple[float, ...] = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                                        2.5, 5.0, 10.0, 30.0)
MAX_HISTOGRAMS = 1000  # workloads with a latency histogram; beyond this, new names share one
_MAX_STREAMS = 10_000  # ordered streams with answers held
_RATE_EVENTS = 4096    # per workload and kind: the events a windowed rate is read from


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
    max_pending: int = 10_000        # all workloads: beyond this, new requests are refused at once (memory)
    max_outstanding: int = 64        # per chain (a device's queue): the bound while nothing is measured
    default_timeout_s: float = 5.0   # a request without a timeout, of a workload without slo_s
    max_timeout_s: float = 120.0
    probe_interval_s: float = 1.0    # an idle chain takes one request this often whatever its prediction
    spread: bool = True              # over every healthy chain (False: the primary only, the old router)
    admit: bool = True               # refuse what cannot finish in time (False: queue until it times out)
    overhead_gain: float = 0.2       # EWMA weight of each answer in a chain's learned overhead
    max_overhead_s: float = 5.0
    # Admit only with this many mean deviations of the chain's prediction error to spare (TCP's
    # RTO rule): a queue predicted to end just before the deadline ends after it half the time.
    margin_devs: float = 2.0


@dataclass(frozen=True, slots=True)
class SendActivation:
    device: str
    activation: Activation


@dataclass(frozen=True, slots=True)
class ReplyClient:
    reply_to: str
    result: InferenceResult


Command = SendActivation | ReplyClient


@dataclass(frozen=True, slots=True)
class WorkloadStats:
    """What an autoscaler reads of one workload over the last ``window_s`` (rates per second)."""

    offered_rps: float      # requests received (admitted or refused)
    goodput_rps: float      # answered within their deadline
    shed_rps: float         # refused at admission (predicted to miss their deadline)
    utilization: float      # busy share of the chains' bottleneck stages (0..1; 0 when unmeasured)
    chains: int
    outstanding: int        # requests in flight now


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
    sent_at: float = 0.0
    work: tuple[tuple[str, float], ...] = ()  # (device, stage s) this attempt adds to device queues
    wait_s: float = 0.0       # predicted queueing when sent (for the chain's learned overhead)
    stream: tuple[str, str] | None = None


@dataclass(slots=True)
class _Rates:
    offered: deque[float] = field(default_factory=lambda: deque(maxlen=_RATE_EVENTS))
    good: deque[float] = field(default_factory=lambda: deque(maxlen=_RATE_EVENTS))
    shed: deque[float] = field(default_factory=lambda: deque(maxlen=_RATE_EVENTS))
    answered: deque[float] = field(default_factory=lambda: deque(maxlen=_RATE_EVENTS))


def _rate(ts: deque[float], now: float, window_s: float) -> float:
    if not ts:
        return 0.0
    start = now - window_s
    if ts[0] >= start and len(ts) == ts.maxlen:  # the deque holds less than the window
        span = max(now - ts[0], 1e-9)
        return len(ts) / span
    return sum(1 for t in ts if t >= start) / window_s


class Router:
    """Pending inference requests of one fog broker; one owner thread drives it."""

    def __init__(self, reply_topic: str, config: RouterConfig | None = None) -> None:
        self.reply_topic = reply_topic
        self.config = config or RouterConfig()
        self._pending: dict[str, _Pending] = {}   # attempt id -> pending
        self._by_request: dict[str, str] = {}     # client request id -> attempt id
        self.counters: dict[str, int] = {"accepted": 0, "answered": 0, "failed": 0, "retries": 0,
                                          "timeouts": 0, "late": 0, "refused": 0, "shed": 0,
                                          "in_deadline": 0, "expired_unsent": 0, "impossible": 0,
                                          "probes": 0}
        self.latencies: deque[float] = deque(maxlen=10_000)  # answered requests, receive -> answer (s)
        self.latency_by_workload: dict[str, deque[float]] = {}
        self.latency_histograms: dict[str, LatencyHistogram] = {}  # workload -> all its answered requests
        # (workload, version, replica) -> each partition's output wire (``runtime.activations``),
        # set once the fog chose them; routes of chains not here carry float32.
        self.wires: dict[tuple[str, int, int], tuple[str, ...]] = {}
        self.wire_reports: dict[tuple[str, int, int], dict[str, object]] = {}
        self._answered_at: dict[str, deque[float]] = {}  # workload -> last answers (monotonic)
        # what a request sent down a chain now would take (stage times, device queues, overheads)
        self.model = CompletionModel(self.config.overhead_gain, self.config.max_overhead_s,
                                     self.config.margin_devs)
        self.slo_s: dict[str, float] = {}              # workload -> its deadline when a request has none
        self._outstanding: dict[tuple[str, int], int] = {}  # (workload, replica) -> attempts in flight
        self._rates: dict[str, _Rates] = {}
        self._streams: dict[tuple[str, str], deque[str]] = {}  # (reply_to, stream) -> request ids, in order
        self._held: dict[tuple[tuple[str, str], str], ReplyClient] = {}  # (stream, id) finished early, waiting
        self._probed: dict[tuple[str, int], float] = {}  # (workload, replica) -> last idle probe
        # answered attempts the router timed: (workload, chain, round trip beyond predicted queueing);
        # the site core drains it to check the devices' claimed stage times (``claim_check``)
        self.observed: deque[tuple[str, Chain, float, list[float] | None, float]] = deque(maxlen=4096)

    def __len__(self) -> int:
        return len(self._pending)

    # ------------------------------------------------------------ inputs

    def set_slo(self, workload: str, slo_s: float | None) -> None:
        """The workload's deadline for requests that carry none (``slo_s`` of its spec; None: the default)."""
        if slo_s is None:
            self.slo_s.pop(workload, None)
        else:
            self.slo_s[workload] = float(slo_s)

    def note_stage(self, key: StageKey, seconds: float) -> None:
        """A device measured this stage's compute (its p50, or its load-time calibration)."""
        self.model.note_stage(key, seconds)

    def note_batch(self, key: StageKey, max_batch: int, slope: float) -> None:
        """A stage runs up to ``max_batch`` queued frames as one batch at this measured cost slope
        (``runtime.batch_cost``): its queue drains sublinearly, and predictions say so (issue 33)."""
        self.model.note_batch(key, max_batch, slope)

    def forget_workload(self, workload: str) -> None:
        """A removed workload: drop its measurements (its requests in flight end as usual)."""
        self.model.forget(workload)
        self.slo_s.pop(workload, None)

    def submit(self, req: InferenceRequest, chains: Sequence[Chain], now: float, wall: float,
               why_none: str = "") -> list[Command]:
        """Accept a request and route it on the chain that finishes it first, or answer at once."""
        if req.request_id in self._by_request:
            return []  # a QoS1 duplicate of a request in flight
        rates = self._rates_of(req.workload)
        if rates is not None:
            rates.offered.append(now)
        if len(self._pending) >= self.config.max_pending:
            self.counters["refused"] += 1
            return [self._error(req, f"router overloaded ({len(self._pending)} requests pending)", "overloaded",
                                retry_after=1.0)]
        if not chains:
            self.counters["refused"] += 1
            return [self._error(req, f"workload '{req.workload}' has no running replica"
                                     + (f": {why_none}" if why_none else ""),
                                "unknown" if why_none == "unknown workload" else "not ready")]
        timeout = req.timeout_s if req.timeout_s > 0 else self.slo_s.get(req.workload, self.config.default_timeout_s)
        timeout = min(timeout, self.config.max_timeout_s)
        deadline = now + timeout
        usable = chains if self.config.spread else chains[:1]
        chain, pred = self._choose(req.workload, usable, set(), timeout)
        if chain is None:
            return [self._shed(req, now, f"every replica chain of '{req.workload}' has "
                                         f"{self.config.max_outstanding} requests outstanding", 1.0)]
        # An idle chain takes one request now and then whatever its prediction says: what it learned
        # (a first answer slowed by a pause) is only ever corrected by answers, so a chain refused on
        # its prediction alone could refuse everything for good.
        ckey = (req.workload, chain[0])
        probe = self.config.admit and self._outstanding.get(ckey, 0) == 0 \
            and now - self._probed.get(ckey, -math.inf) >= self.config.probe_interval_s
        fastest = None if pred is None else self.model.unloaded(req.workload, usable)  # unmeasured: no verdict
        if probe and ((fastest is not None and fastest > timeout)
                      or (pred is not None and now + pred + self.model.margin(req.workload, chain) > deadline)):
            self._probed[ckey] = now
            self.counters["probes"] += 1
        elif self.config.admit and fastest is not None and fastest > timeout:
            # not load: no chain meets it even idle, so a later retry would not either (504, no Retry-After)
            self.counters["refused"] += 1
            self.counters["impossible"] += 1
            return [self._error(req, f"deadline {timeout:.3g} s is shorter than the fastest chain takes "
                                     f"unloaded ({fastest:.3g} s): it cannot be met", "timeout")]
        elif self.config.admit and pred is not None and now + pred + self.model.margin(req.workload, chain) > deadline:
            return [self._shed(req, now, f"predicted to finish in {pred:.3g} s, after its deadline "
                                         f"({timeout:.3g} s)", pred - timeout)]
        self.counters["accepted"] += 1
        p = _Pending(req, now, deadline, 0.0, 0, chain)
        if req.stream:
            # a client's streams are its own: keyed by its reply topic (in-process front ends, whose
            # every request has a reply_to of its own, name their caller in the stream)
            key = ("local:" if req.reply_to.startswith("local:") else req.reply_to, req.stream)
            q = self._streams.get(key)
            if q is not None and (req.request_id in q or len(q) >= self.config.max_outstanding * 4):
                # an id already waiting for its turn would hold the stream for good; a stream is bounded
                self.counters["accepted"] -= 1
                self.counters["refused"] += 1
                return [self._error(req, f"stream '{req.stream[:60]}': request id already queued or too many "
                                         "in flight", "overloaded", retry_after=1.0)]
            if key in self._streams or len(self._streams) < _MAX_STREAMS:
                p.stream = key
                self._streams.setdefault(key, deque()).append(req.request_id)
        return self._send(p, chain, pred, chains, now, wall)

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
        self._end_attempt(res.request_id, p)
        if res.ok:
            self.model.learn(p.request.workload, p.chain, now - p.sent_at, p.wait_s)
            self.observed.append((p.request.workload, p.chain, max(0.0, now - p.sent_at - p.wait_s),
                                  self.model.stages(p.request.workload, p.chain), now))
            self.counters["answered"] += 1
            wl = p.request.workload
            took = now - p.received_at
            self.latencies.append(took)
            self.latency_by_workload.setdefault(wl, deque(maxlen=500)).append(took)
            self._observe(wl, took)
            if len(self._answered_at) < MAX_HISTOGRAMS or wl in self._answered_at:
                self._answered_at.setdefault(wl, deque(maxlen=256)).append(now)
            rates = self._rates_of(wl)
            if rates is not None:
                rates.answered.append(now)
            if now <= p.deadline:
                self.counters["in_deadline"] += 1
                if rates is not None:
                    rates.good.append(now)
            return self._finish(p, ReplyClient(p.request.reply_to, InferenceResult(
                p.request.request_id, True, dict(res.tensors), "", res.device_id, p.chain[0], took)))
        p.errors.append(f"replica {p.chain[0]}: {res.error or 'error'}"
                        + (f" (at {res.device_id})" if res.device_id else ""))
        return self._retry(p, chains, now, wall)

    def device_lost(self, device_id: str, chains_of: Mapping[str, Sequence[Chain]], now: float,
                    wall: float) -> list[Command]:
        """Requests in flight through a lost device fail over now instead of at their timeout."""
        out: list[Command] = []
        for aid, p in list(self._pending.items()):
            if any(h.device_id == device_id for h in p.chain[1]):
                self._end_attempt(aid, p)
                p.errors.append(f"replica {p.chain[0]}: device {device_id} lost")
                out.extend(self._retry(p, chains_of.get(p.request.workload, ()), now, wall))
        self.model.work.pop(device_id, None)
        return out

    def tick(self, now: float, chains_of: Mapping[str, Sequence[Chain]], wall: float) -> list[Command]:
        out: list[Command] = []
        for aid, p in list(self._pending.items()):
            if now < p.attempt_deadline:
                continue
            if self.config.admit and now < p.deadline:
                # Its attempt's share ran out: another chain only if it can still finish in time,
                # else this attempt keeps its chain until the deadline (it may still make it).
                chains = chains_of.get(p.request.workload, ())
                fresh = [c for c in chains if _chain_id(c) not in p.tried]
                chain, pred = self._choose(p.request.workload, fresh, set(), p.deadline - now)
                if (chain is None or p.attempt >= self.config.max_attempts
                        or (pred is not None and now + pred + self.model.margin(p.request.workload, chain)
                            > p.deadline)):
                    p.attempt_deadline = p.deadline
                    continue
            self._end_attempt(aid, p)
            self.counters["timeouts"] += 1
            p.errors.append(f"replica {p.chain[0]}: timed out")
            out.extend(self._retry(p, chains_of.get(p.request.workload, ()), now, wall))
        return out

    # ------------------------------------------------------------ reading

    def predict(self, workload: str, chains: Sequence[Chain]) -> float | None:
        """Seconds a new request of ``workload`` would take on its best chain now (None: unmeasured)."""
        return self._choose(workload, chains, set())[1]

    def stats(self, workload: str, chains: Sequence[Chain], now: float, window_s: float = 10.0) -> WorkloadStats:
        """Offered rate, goodput, shed rate and utilisation of one workload (what an autoscaler reads)."""
        r = self._rates.get(workload) or _Rates()
        answered = _rate(r.answered, now, window_s)
        bottlenecks = [b for b in (self.model.bottleneck(workload, c) for c in chains) if b > 0]
        util = 0.0
        if bottlenecks and chains:
            util = min(1.0, answered * (sum(bottlenecks) / len(bottlenecks)) / len(chains))
        out = sum(v for (w, _), v in self._outstanding.items() if w == workload)
        return WorkloadStats(_rate(r.offered, now, window_s), _rate(r.good, now, window_s),
                             _rate(r.shed, now, window_s), util, len(chains), out)

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

    def _rates_of(self, workload: str) -> _Rates | None:
        r = self._rates.get(workload)
        if r is None and len(self._rates) < MAX_HISTOGRAMS:
            r = self._rates[workload] = _Rates()
        return r

    def _observe(self, workload: str, seconds: float) -> None:
        h = self.latency_histograms.get(workload)
        if h is None:
            if len(self.latency_histograms) >= MAX_HISTOGRAMS:
                workload = "(other)"  # a bounded number of series whatever clients name
            h = self.latency_histograms.setdefault(workload, LatencyHistogram())
        h.observe(seconds)

    def bottleneck_s(self, workload: str, chains: Sequence[Chain]) -> float:
        """The measured slowest stage (s) of ``workload``'s chains, averaged over those measured (0: none)."""
        b = [x for x in (self.model.bottleneck(workload, c) for c in chains) if x > 0]
        return sum(b) / len(b) if b else 0.0

    def _choose(self, workload: str, chains: Sequence[Chain], skip: set[tuple[int, int]],
                left: float = math.inf) -> tuple[Chain | None, float | None]:
        """The chain predicted to finish a new request first, and its predicted seconds (None: some
        stage unmeasured). A measured chain that finishes within ``left`` seconds comes first, then
        an unmeasured one (the fewest requests outstanding: a chain just placed, not yet timed),
        then the measured one that finishes first (which admission then refuses)."""
        best: tuple[tuple[float, float, int], Chain, float | None] | None = None
        for c in chains:
            if _chain_id(c) in skip or not c[1]:
                continue
            n = self._outstanding.get((workload, c[0]), 0)
            if n >= self.config.max_outstanding:
                continue
            pred = self.model.predict(workload, c)
            rank = 1.0 if pred is None else 0.0 if pred + self.model.margin(workload, c) <= left else 2.0
            key = (rank, pred if pred is not None else float(n), c[0])
            if best is None or key < best[0]:
                best = (key, c, pred)
        if best is None:
            return None, None
        return best[1], best[2]

    def _end_attempt(self, aid: str, p: _Pending) -> None:
        """The attempt is over (answered, failed, lost or timed out): its work leaves the queues."""
        del self._pending[aid]
        del self._by_request[p.request.request_id]
        for dev, s in p.work:
            left = self.model.work.get(dev, 0.0) - s
            if left > 1e-9:
                self.model.work[dev] = left
            else:
                self.model.work.pop(dev, None)
        p.work = ()
        key = (p.request.workload, p.chain[0])
        n = self._outstanding.get(key, 0) - 1
        if n > 0:
            self._outstanding[key] = n
        else:
            self._outstanding.pop(key, None)

    def _retry(self, p: _Pending, chains: Sequence[Chain], now: float, wall: float) -> list[Command]:
        if p.attempt < self.config.max_attempts and now < p.deadline:
            chain, pred = self._choose(p.request.workload, chains, p.tried, p.deadline - now)
            if chain is not None and (not self.config.admit or pred is None
                                      or now + pred + self.model.margin(p.request.workload, chain) <= p.deadline):
                self.counters["retries"] += 1
                return self._send(p, chain, pred, chains, now, wall)
        self.counters["failed"] += 1
        timed_out = now >= p.deadline or (bool(p.errors) and all(e.endswith("timed out") for e in p.errors))
        return self._finish(p, self._error(p.request, "; ".join(p.errors), "timeout" if timed_out else "failed"))

    def _send(self, p: _Pending, chain: Chain, pred: float | None, chains: Sequence[Chain], now: float,
              wall: float) -> list[Command]:
        # ``wall`` is always the fog's wall clock: ``SiteCore`` supplies it, also for a loss heard
        # in an advert (from the offset its last tick saw).
        remaining = p.deadline - now
        if remaining <= 0:  # expired work is not sent
            self.counters["expired_unsent"] += 1
            self.counters["failed"] += 1
            p.errors.append("deadline passed before it could be sent")
            return self._finish(p, self._error(p.request, "; ".join(p.errors), "timeout"))
        p.chain = chain
        p.attempt += 1
        p.tried.add(_chain_id(chain))
        others = [c for c in chains if _chain_id(c) not in p.tried]
        if others and p.attempt < self.config.max_attempts:
            # Leave part of the budget for a failover when another chain could take it: half of it
            # (the old router), or half of what the prediction leaves over.
            share = remaining / 2 if pred is None or not self.config.admit else pred + max(0.0, remaining - pred) / 2
        else:
            share = remaining
        p.attempt_deadline = now + min(share, remaining)
        p.sent_at = now
        wl = p.request.workload
        stages = self.model.stages(wl, chain)
        p.wait_s = max(self.model.work.get(h.device_id, 0.0) for h in chain[1]) if chain[1] else 0.0
        if stages is not None:
            p.work = tuple((h.device_id, s) for h, s in zip(chain[1], stages))
            for dev, s in p.work:
                self.model.work[dev] = self.model.work.get(dev, 0.0) + s
        key = (wl, chain[0])
        self._outstanding[key] = self._outstanding.get(key, 0) + 1
        aid = f"{p.request.request_id}#{p.attempt}"
        self._pending[aid] = p
        self._by_request[p.request.request_id] = aid
        route = chain[1]
        wires = self.wires.get((wl, route[0].version, chain[0])) if route else None
        if wires:
            route = tuple(replace(h, wire=wires[h.index]) if h.index < len(wires) else h
                          for h in route)
        act = Activation(aid, wl, route, 0, self.reply_topic, dict(p.request.tensors), wall + remaining)
        return [SendActivation(chain[1][0].device_id, act)]

    def _finish(self, p: _Pending, reply: ReplyClient) -> list[Command]:
        """The request's one answer, released in its stream's order when it names one."""
        if p.stream is None:
            return [reply]
        q = self._streams.get(p.stream)
        if q is None:
            return [reply]
        rid = p.request.request_id
        if q[0] != rid:
            self._held[(p.stream, rid)] = reply
            return []
        out: list[Command] = [reply]
        q.popleft()
        while q and (p.stream, q[0]) in self._held:
            out.append(self._held.pop((p.stream, q.popleft())))
        if not q:
            del self._streams[p.stream]
        return out

    def _shed(self, req: InferenceRequest, now: float, why: str, retry_after: float) -> ReplyClient:
        self.counters["refused"] += 1
        self.counters["shed"] += 1
        rates = self._rates_of(req.workload)
        if rates is not None:
            rates.shed.append(now)
        return self._error(req, f"overloaded: {why}", "overloaded", retry_after=max(retry_after, 0.001))

    def _error(self, req: InferenceRequest, error: str, failure: str, retry_after: float = 0.0) -> ReplyClient:
        return ReplyClient(req.reply_to, InferenceResult(req.request_id, False, {}, error[:2000], failure=failure,
                                                         retry_after_s=round(retry_after, 3)))
