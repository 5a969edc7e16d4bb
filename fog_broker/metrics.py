"""Prometheus metrics of a fog broker, read from its state when scraped (``render(svc)``).

A custom collector, not instrumented code: each scrape reads the site core's
frozen snapshot (``svc.snapshot``: built by the owner thread between two inbox
items, never queued behind them) -- the ``fogline status`` document without its
device rows, plus the few raw figures that document merges or trims -- and
``families(snapshot)`` turns it into metric families. The cores' own counters
are the only counts (nothing is counted twice, nothing is added to the hot
path), and every counter of the snapshot is exported exactly once: a counter
this module has no name for yet appears under ``fogline_fog_events_total``.

Serving: ``HttpApi.extend(register_http)`` adds ``GET /metrics`` to the fog's
HTTP server (same authentication as the rest of the API, the ``status``
right); elsewhere ``render(svc, accept)`` gives ``(body, content_type)`` (it
may wait for the owner thread's next snapshot: call it off an event loop). Metric names and
labels are listed in ``METRICS`` (the Grafana dashboard under ``deploy/`` uses
them, a test checks it). Inference latency histograms come from the snapshot's
``latency`` (workload -> bucket bounds, per-bucket counts, sum: the router's).
"""
from __future__ import annotations

import math
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from prometheus_client.core import (
    GaugeMetricFamily,
    Metric,
)
from prometheus_client.exposition import choose_encoder

from runtime.metric_families import Families

from .snapshot import counter_copy

if TYPE_CHECKING:
    from aiohttp import web

    from .http_api import HttpApi
    from .port import FogPort

__all__ = ["METRICS", "PREFIX", "RECOVERY_BUCKETS_S", "FogCollector", "exposition", "families", "register_http",
           "render", "scrape_families", "snapshot"]

PREFIX = "fogline_fog"
RECOVERY_BUCKETS_S: tuple[float, ...] = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
PHASES = ("pending", "deploying", "running", "unconfirmed", "lost")
WORKLOAD_STATUSES = ("pending", "deploying", "running", "degraded")
ADVERT_KINDS = ("BIRTH", "STATE", "DEATH", "ACK")
SCRAPE_TIMEOUT_S = 5.0

# name (without the prefix) -> (type, labels, help). ``families`` emits nothing outside this table.
METRICS: dict[str, tuple[str, tuple[str, ...], str]] = {
    "info": ("info", ("fog_id", "site", "epoch", "secure"), "This fog broker: id, site, epoch, TLS on or off"),
    "owner_responsive": ("gauge", (), "1 when the fog's owner thread answered this scrape, 0 when it did not"),
    "scrape_duration_seconds": ("gauge", (), "Time taken to snapshot the fog's state for this scrape"),
    "ready": ("gauge", (), "1 once the fog heard its devices after a (re)start and places work"),
    "uptime_seconds": ("gauge", (), "Seconds since this fog broker process started"),
    "devices": ("gauge", ("state",), "Devices known to the registry by liveness: live, suspect, dead, unknown"),
    "enrolment": ("gauge", ("state",), "Enrolled device ids not (or no longer) trusted: pending approval, revoked"),
    "identities": ("gauge", ("role", "state"), ("Issued identities (operators, coordinators, apps) by role: "
                                             "active or revoked")),
    "utilization_ratio": ("gauge", (), "Memory of the placed partitions over the memory of live devices"),
    "fragmentation_ratio": ("gauge", (), "Share of free memory in pieces too small for the smallest partition"),
    "workloads": ("gauge", ("status",), "Workloads by status: pending, deploying, running, degraded"),
    "workload_replicas": ("gauge", ("workload",), "Replica chains a workload asks for"),
    "workload_replicas_healthy": ("gauge", ("workload",), "Replica chains of a workload running end to end"),
    "workload_replicas_wanted": ("gauge", ("workload",), ("Replica chains a workload wants now (its autoscaler's "
                                                           "count or its rate_fps' floor; else its replicas)")),
    "workload_offered_rps": ("gauge", ("workload",), "Requests offered per second (admitted or refused), last window"),
    "workload_goodput_rps": ("gauge", ("workload",), "Requests answered within their deadline per second, last window"),
    "workload_shed_rps": ("gauge", ("workload",), "Requests refused at admission per second, last window"),
    "workload_scale_events": ("counter", ("workload", "direction"), "Autoscaler decisions: up, down"),
    "workload_predicted_latency_seconds": ("gauge", ("workload",),
                                           "Cost model's end-to-end latency of the best placed replica"),
    "placements": ("gauge", ("workload", "phase"), ("Partition placements by phase: pending, deploying, running, "
                                                  "unconfirmed, lost")),
    "pending_workloads": ("gauge", ("reason",), ("Workloads the scheduler cannot place, by gate (fit, selector, "
                                               "taint, energy, alive, quota, anti-affinity, ...)")),
    "workload_pending": ("gauge", ("workload", "reason"), "1 for each gate that keeps a workload from placing"),
    "quota_bytes": ("gauge", ("tenant",), "Memory quota of a tenant"),
    "release_version": ("gauge", ("release",), "Newest accepted version of each model release"),
    "inference_in_flight": ("gauge", (), "Inference requests routed and not yet answered"),
    "adverts_accepted": ("counter", ("kind",), "Device messages verified and accepted: BIRTH, STATE, DEATH, ACK"),
    "advert_rejections": ("counter", ("reason",), "Device messages refused at ingest, by reason"),
    "adverts_flagged": ("counter", (), "Births with implausible capacity, clamped"),
    "dropped": ("counter", ("queue",), "Messages dropped because a queue was full: verify, inbox"),
    "adverts_limited": ("counter", ("kind",), ("Device messages dropped before any check: over their sender's "
                                               "budget (by kind), or from a quarantined sender (quarantined)")),
    "control_limited": ("counter", ("reason",), ("fog/CTL requests dropped before any check: over their signer's "
                                                 "budget, or from a quarantined signer")),
    "sender_drops": ("counter", ("source", "identity"), ("Messages dropped over budget or in quarantine, by "
                                                         "sender (the 20 senders with the most drops; source: "
                                                         "devices or control)")),
    "quarantined": ("gauge", ("source", "identity"), ("1 for each sender quarantined for flooding now (the "
                                                      "reason is in `fogline status`)")),
    "rebirths": ("counter", ("outcome",), "Rebirth requests to devices: asked, limited (rate limit)"),
    "device_losses": ("counter", (), "Devices declared lost (death, missed states, revocation)"),
    "devices_revoked": ("counter", (), "Devices cut off by a revocation or a re-key in trust.db (this run)"),
    "deploys": ("counter", (), "Signed partition deploys published to devices"),
    "undeploys": ("counter", (), "Partition undeploys published to devices"),
    "controller_events": ("counter", ("event",), "Deployment controller events: plans, repairs, retries, nacks, ..."),
    "recovery_seconds": ("histogram", (), "Loss of a partition detected -> its replacement running"),
    "inference_requests": ("counter", ("outcome",), "Inference requests by outcome: answered, failed, refused"),
    "inference_failovers": ("counter", (), "Inference attempts retried on another replica chain"),
    "inference_shed": ("counter", (), ("Inference requests refused at admission: no replica chain was predicted "
                                       "to finish them within their deadline (also counted refused)")),
    "inference_in_deadline": ("counter", (), "Inference requests answered within their deadline (goodput)"),
    "inference_expired_unsent": ("counter", (), "Inference requests whose deadline passed before a retry was sent"),
    "inference_attempt_timeouts": ("counter", (), "Inference attempts that hit their deadline"),
    "inference_results_dropped": ("counter", ("reason",), "Results not relayed: late, wrong sender"),
    "inference_latency_seconds": ("histogram", ("workload",), "Receive -> answer time of answered requests"),
    "control_requests": ("counter", ("action",), "Control requests carried out: hello, status, deploy, delete"),
    "control_refusals": ("counter", ("reason",), "Control and inference requests refused, by reason"),
    "message_rejections": ("counter", ("reason",), ("Messages to the fog (requests, results, releases) refused "
                                                   "before they reach a core")),
    "releases": ("counter", (), "Model releases accepted from a pinned coordinator"),
    "release_refusals": ("counter", ("reason",), "Model releases refused, by reason"),
    "state_reasserted": ("counter", (), "Times something else published on the fog's retained STATE"),
    "errors": ("counter", ("kind",), "Inputs dropped on an error: remote (bad input), internal (owner loop bug), "
                                     "ingest (verify batch lost)"),
    "events": ("counter", ("counter",), "Any other counter of the fog, by its name in `fogline status`"),
}


# ------------------------------------------------------------------ any thread


def snapshot(svc: FogPort, now: float | None = None, timeout: float = SCRAPE_TIMEOUT_S,
             max_age_s: float | None = None) -> dict[str, Any]:
    """What one scrape needs, as plain data (any thread; ``TimeoutError`` when the owner thread does
    not build a snapshot within ``timeout``)."""
    now = time.monotonic() if now is None else now
    site = svc.snapshot(max_age_s, timeout)
    doc = svc.status(now, snapshot=site, limit=0)
    identities = [{"role": r.role, "revoked": bool(r.revoked)} for r in svc.site.db.identities()]
    return {
        "status": doc,
        "service": dict(site.counters),                # the status merges these with ingest's: keep apart
        "ingest": counter_copy(svc.ingest.counts()),
        "recoveries_s": list(site.recoveries_s),       # all of them (status keeps 50)
        "in_flight": site.in_flight,
        "latency": {w: {"bounds": tuple(h["bounds"]), "counts": tuple(h["counts"]), "sum": float(h["sum"])}
                    for w, h in site.latency.items()},
        "identities": identities,
    }


# ------------------------------------------------------------------ pure: snapshot -> families


def _families() -> Families:
    return Families(PREFIX, METRICS)


def _name(short: str) -> str:
    return f"{PREFIX}_{short}"


def _histogram(bounds: Sequence[float], counts: Sequence[int]) -> list[tuple[str, float]]:
    """Per-bucket counts (the last one above every bound) -> cumulative ``(le, count)`` with ``+Inf``."""
    out: list[tuple[str, float]] = []
    acc = 0
    for b, n in zip(bounds, counts):
        acc += int(n)
        out.append((_le(b), float(acc)))
    acc += sum(int(n) for n in counts[len(bounds):])
    out.append(("+Inf", float(acc)))
    return out


def _le(b: float) -> str:
    return repr(float(b))


def bucket_counts(values: Iterable[float], bounds: Sequence[float]) -> list[int]:
    """Per-bucket counts of ``values`` (``len(bounds) + 1`` of them; a value equal to a bound is in it)."""
    import bisect
    counts = [0] * (len(bounds) + 1)
    for v in values:
        counts[bisect.bisect_left(bounds, v)] += 1
    return counts


def families(snap: Mapping[str, Any]) -> list[Metric]:
    """The metric families of one snapshot (pure)."""
    f = _families()
    st: Mapping[str, Any] = snap["status"]
    f.get("info").add_metric([], {"fog_id": str(st.get("fog_id", "")), "site": str(st.get("site", "")),
                                  "epoch": str(st.get("epoch", "")),
                                  "secure": "true" if st.get("secure") else "false"})
    f.add("owner_responsive", 1)
    f.add("ready", 1 if st.get("ready") else 0)
    f.add("uptime_seconds", float(st.get("uptime_s", 0.0)))
    m = st.get("metrics", {})
    known = 0
    for state in ("live", "suspect", "dead"):
        n = int(m.get(f"devices_{state}", 0))
        known += n
        f.add("devices", n, state)
    f.add("devices", max(0, int(st.get("devices_total", known)) - known), "unknown")
    enr = st.get("enrolment", {})
    for state in ("pending", "revoked"):
        f.add("enrolment", len(enr.get(state, ())), state)
    roles: dict[tuple[str, str], int] = {}
    for ident in snap.get("identities", ()):
        key = (str(ident["role"]), "revoked" if ident["revoked"] else "active")
        roles[key] = roles.get(key, 0) + 1
    for (role, state), n in sorted(roles.items()):
        f.add("identities", n, role, state)
    f.add("utilization_ratio", float(m.get("utilization", 0.0)))
    f.add("fragmentation_ratio", float(m.get("fragmentation", 0.0)))

    by_status = dict.fromkeys(WORKLOAD_STATUSES, 0)
    gates: dict[str, int] = {}
    for w in st.get("workloads", ()):
        name = str(w["name"])
        by_status[str(w["status"])] = by_status.get(str(w["status"]), 0) + 1
        f.add("workload_replicas", int(w.get("replicas", 0)), name)
        f.add("workload_replicas_healthy", int(w.get("healthy_replicas", 0)), name)
        sc, sv = w.get("scaling") or {}, w.get("serving") or {}
        if sv:
            f.add("workload_offered_rps", float(sv.get("offered_rps", 0.0)), name)
            f.add("workload_goodput_rps", float(sv.get("goodput_rps", 0.0)), name)
            f.add("workload_shed_rps", float(sv.get("shed_rps", 0.0)), name)
        if sc:
            f.add("workload_replicas_wanted", int(sc.get("replicas_wanted", 0)), name)
            for direction in ("up", "down"):
                f.add("workload_scale_events", int(sc.get(f"scaled_{direction}", 0)), name, direction)
        lat = [r.get("latency_s") for r in w.get("placement", ()) if r.get("latency_s") is not None]
        if lat:
            f.add("workload_predicted_latency_seconds", min(lat), name)
        phases = dict.fromkeys(PHASES, 0)
        for rep in w.get("placement", ()):
            for p in rep.get("partitions", ()):
                phases[str(p["phase"])] = phases.get(str(p["phase"]), 0) + 1
        for phase, n in phases.items():
            f.add("placements", n, name, phase)
        for gate in sorted(w.get("reasons", {}) or {}):
            gates[gate] = gates.get(gate, 0) + 1
            f.add("workload_pending", 1, name, str(gate))
    for status, n in by_status.items():
        f.add("workloads", n, status)
    f.get("pending_workloads")
    for gate, n in sorted(gates.items()):
        f.add("pending_workloads", n, gate)
    for tenant, q in sorted((st.get("quotas") or {}).items()):
        f.add("quota_bytes", float(q), str(tenant))
    for rel, r in sorted((st.get("releases") or {}).items()):
        f.add("release_version", float(r.get("version", 0)), str(rel))
    f.add("inference_in_flight", int(snap.get("in_flight", 0)))

    _counters(f, snap)
    for source, lim in sorted((st.get("limits") or {}).items()):  # fair share (ratelimit.FairShare.view)
        for who, n in sorted((lim.get("dropped") or {}).items()):
            f.add("sender_drops", int(n), str(source), str(who))
        for who in sorted(lim.get("quarantined") or {}):
            f.add("quarantined", 1, str(source), str(who))
    f.get("quarantined")

    rec = [float(x) for x in snap.get("recoveries_s", ())]
    f.get("recovery_seconds").add_metric([], _histogram(RECOVERY_BUCKETS_S, bucket_counts(rec, RECOVERY_BUCKETS_S)),
                                         sum_value=math.fsum(rec))
    lat_fam = f.get("inference_latency_seconds")
    for w, h in sorted((snap.get("latency") or {}).items()):
        lat_fam.add_metric([str(w)], _histogram(h["bounds"], h["counts"]), sum_value=float(h["sum"]))
    return f.in_table_order()


# Which counter of which source goes where: (source, key or prefix, metric, label or None).
# A key ending in ':' or '.' is a prefix: the rest of the key is the label value.
_ROUTES: tuple[tuple[str, str, str, str | None], ...] = (
    ("ingest", "in:", "adverts_accepted", "kind"),
    ("ingest", "rejected:", "advert_rejections", "reason"),
    ("ingest", "flagged:capacity", "adverts_flagged", None),
    ("ingest", "verify_overflow", "dropped", "verify"),
    ("ingest", "limited:", "adverts_limited", "kind"),
    ("ingest", "internal_errors", "errors", "ingest"),
    ("service", "inbox_overflow", "dropped", "inbox"),
    ("service", "rebirths_asked", "rebirths", "asked"),
    ("service", "rebirths_limited", "rebirths", "limited"),
    ("service", "devices_lost", "device_losses", None),
    ("service", "devices_revoked", "devices_revoked", None),
    ("service", "deploys_sent", "deploys", None),
    ("service", "undeploys_sent", "undeploys", None),
    ("service", "releases", "releases", None),
    ("service", "release:", "release_refusals", "reason"),
    ("service", "rejected:", "message_rejections", "reason"),
    ("service", "fog_state_reasserted", "state_reasserted", None),
    ("service", "remote_errors", "errors", "remote"),
    ("service", "internal_errors", "errors", "internal"),
    ("router", "answered", "inference_requests", "answered"),
    ("router", "failed", "inference_requests", "failed"),
    ("router", "refused", "inference_requests", "refused"),
    ("router", "retries", "inference_failovers", None),
    ("router", "shed", "inference_shed", None),
    ("router", "in_deadline", "inference_in_deadline", None),
    ("router", "expired_unsent", "inference_expired_unsent", None),
    ("router", "timeouts", "inference_attempt_timeouts", None),
    ("router", "late", "inference_results_dropped", "late"),
    ("router", "wrong sender", "inference_results_dropped", "wrong sender"),
    ("router", "accepted", "", None),   # = answered + failed + in flight: not a count of its own
    ("control", "ok:", "control_requests", "action"),
    ("control", "rejected:", "control_refusals", "reason"),
    ("control", "refused", "control_refusals", "refused"),   # signed and fresh, but not allowed or not valid
    ("control", "limited:", "control_limited", "reason"),
    ("controller", "deploys", "", None),     # the commands behind deploys_sent / undeploys_sent
    ("controller", "undeploys", "", None),
    ("controller", "", "controller_events", "event"),
)


def _sources(snap: Mapping[str, Any]) -> dict[str, dict[str, int]]:
    """Counters by source: the service's and ingest's raw, the cores' from the status document's prefixes."""
    out: dict[str, dict[str, int]] = {"service": dict(snap.get("service", {})), "ingest": dict(snap.get("ingest", {})),
                                      "router": {}, "control": {}, "controller": {}, "other": {}}
    for k, v in (snap["status"].get("counters") or {}).items():
        head, dot, rest = str(k).partition(".")
        if dot and head in ("router", "control", "controller"):
            out[head][rest] = int(v)
        elif k == "registry.stale":
            out["other"][k] = int(v)
        # verifier.* are ingest.rejections() again (already under advert_rejections) and verifier.accepted
        # is the sum of adverts_accepted; the unprefixed rest merges the service's and ingest's (read raw)
    return out


# Label values every scrape carries (at 0 until they happen), so rates and alerts have a series.
_SEEDED: dict[str, tuple[str, ...]] = {
    "adverts_accepted": ADVERT_KINDS,
    "dropped": ("verify", "inbox"),
    "adverts_limited": (*ADVERT_KINDS, "quarantined"),
    "control_limited": ("over budget", "quarantined"),
    "rebirths": ("asked", "limited"),
    "inference_requests": ("answered", "failed", "refused"),
    "inference_results_dropped": ("late", "wrong sender"),
    "errors": ("remote", "internal", "ingest"),
}


def _route(source: str, key: str) -> tuple[str, str | None]:
    """``(metric, label value)`` of one counter; ``("", None)``: deliberately not exported."""
    for src, pat, metric, label in _ROUTES:
        if src != source:
            continue
        if pat == "" or pat.endswith((":", ".")):
            if key.startswith(pat):
                return metric, key[len(pat):] if label in ("kind", "reason", "action", "event") else label
        elif key == pat:
            return metric, label
    return "events", key if source in ("service", "ingest", "other") else f"{source}.{key}"


def _counters(f: Families, snap: Mapping[str, Any]) -> None:
    values: dict[tuple[str, str | None], float] = {}
    for short, (kind, labels, _) in METRICS.items():
        if kind == "counter":
            f.get(short)
            if not labels:
                values[(short, None)] = 0.0
    for short, seeded in _SEEDED.items():
        for label in seeded:
            values[(short, label)] = 0.0
    for source, counts in _sources(snap).items():
        for key, n in counts.items():
            route = _route(source, key)
            if route[0]:
                values[route] = values.get(route, 0.0) + n
    for (metric, lv), value in sorted(values.items(), key=lambda kv: (kv[0][0], kv[0][1] or "")):
        if lv is None:
            f.add(metric, value)
        else:
            f.add(metric, value, lv)


# ------------------------------------------------------------------ the collector


def scrape_families(snap: Mapping[str, Any] | None, took_s: float) -> list[Metric]:
    """The families of one scrape: ``families(snap)``, or (``None``: the owner thread did not answer)
    only ``owner_responsive 0``; either way with the time the snapshot took."""
    if snap is None:
        # a stuck owner loop is itself the most important figure: say so instead of failing the scrape
        f = _families()
        f.add("owner_responsive", 0)
        out = list(f.fams.values())
    else:
        out = families(snap)
    dur = GaugeMetricFamily(_name("scrape_duration_seconds"), METRICS["scrape_duration_seconds"][2])
    dur.add_metric([], took_s)
    return [*out, dur]


class _Fixed:
    """Families already built, in the shape the exposition encoders take (``collect()``)."""

    def __init__(self, fams: list[Metric]) -> None:
        self.fams = fams

    def collect(self) -> list[Metric]:
        return self.fams


def exposition(fams: list[Metric], accept: str | None = None) -> tuple[bytes, str]:
    """``(body, content_type)`` of these families: the text format, or OpenMetrics when ``accept`` asks."""
    encoder, content_type = choose_encoder(accept or "")
    return encoder(_Fixed(fams)), content_type


class FogCollector:
    """A ``prometheus_client`` collector over one running ``FogService`` (reads its state when scraped)."""

    def __init__(self, svc: FogPort, timeout_s: float = SCRAPE_TIMEOUT_S) -> None:
        self.svc = svc
        self.timeout_s = timeout_s

    def collect(self) -> Iterator[Metric]:
        t0 = time.monotonic()
        try:
            snap = snapshot(self.svc, timeout=self.timeout_s)
        except TimeoutError:
            snap = None
        yield from scrape_families(snap, time.monotonic() - t0)

    def describe(self) -> list[Metric]:
        return []  # nothing to check at registration: the names are fixed by METRICS


def render(svc: FogPort, accept: str | None = None) -> tuple[bytes, str]:
    """The ``/metrics`` answer: ``(body, content_type)``; OpenMetrics when ``accept`` asks for it.

    May wait for the owner thread's next snapshot (at most ``SCRAPE_TIMEOUT_S``): call it off an
    event loop (``register_http`` does).
    """
    return exposition(list(FogCollector(svc).collect()), accept)


def register_http(app: web.Application, api: HttpApi, *, right: str = "status") -> None:
    """``GET /metrics`` on the fog's HTTP server (``HttpApi.extend(metrics.register_http)``).

    Callers authenticate as on the rest of the API (site-CA client certificate or API token) and
    need ``right`` (``status``: operators and coordinators). The snapshot is read off the server's
    loop (``api.off_loop``).
    """
    from aiohttp import web

    async def metrics(request: web.Request) -> web.Response:
        api.principal(request, right)
        t0 = time.monotonic()
        try:
            snap = await api.off_loop(snapshot, api.svc)
        except TimeoutError:
            snap = None
        body, content_type = exposition(scrape_families(snap, time.monotonic() - t0),
                                        request.headers.get("Accept"))
        return web.Response(body=body, headers={"Content-Type": content_type, "Cache-Control": "no-store"})

    app.router.add_get("/metrics", metrics)
