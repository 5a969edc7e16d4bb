"""What ``fogline status`` shows: a JSON document built from the cores on the owner thread.

Devices are paginated (``offset``/``limit``): a site of thousands of devices
answers in bounded time and bytes, and ``devices_total`` says how many there
are. Everything else (workloads, metrics, counters) is small.
"""
from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from .registry import capacity_flags

if TYPE_CHECKING:
    from .shell import FogShell as FogService

__all__ = ["site_status", "DEFAULT_DEVICE_PAGE", "MAX_DEVICE_PAGE"]

DEFAULT_DEVICE_PAGE = 1000
MAX_DEVICE_PAGE = 5000


def _device_row(svc: FogService, did: str, now: float) -> dict[str, Any]:
    rec = svc.registry.devices[did]
    b, st = rec.birth, rec.state
    return {
        "id": did, "alive": rec.alive, "status": rec.status.value, "epoch": rec.epoch,
        "last_seen_s": round(now - rec.last_seen, 3) if math.isfinite(rec.last_seen) else None,
        "lost_reason": rec.lost_reason or None,
        "labels": dict(b.labels) if b else {},
        "taints": [f"{t.key}={t.value}:{t.effect}" for t in b.taints] if b else [],
        "memory_bytes": b.memory_bytes if b else None,
        "free_memory_bytes": st.free_memory_bytes if st else None,
        "battery_level": st.battery_level if st else None,
        "charging": st.charging if st else None,
        "clock_skew_s": st.clock_skew_s if st is not None and st.clock_skew_s is not None else None,
        "flags": list(capacity_flags(rec)),  # a clean birth and an agreeing calibration clear them
        # an advert of this device failed validation ("DeviceBirth.rtt_s=-1.0"): it holds nothing
        "rejected": rec.rejected or None,
        "set_aside": rec.set_aside or None,  # its record failed conversion: left out of placement
        # a stage it ran stayed slower than the plan (measured p50s): it takes no partition for a while
        "slow": svc.core.slow_stages.reason_of(did),
        "partitions": [f"{p.workload}/v{p.version}/r{p.replica}/p{p.index}:{p.health}" for p in rec.partitions()],
    }


def _stages(svc: FogService, name: str, version: int, replica: int,
            parts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A chain's pipeline stages in order (``placement.cost.stage_times``): each partition's
    compute, predicted on its device and measured (the p50 its device reports), and each link a
    frame crosses with the bytes per frame on its wire and the serialisation time predicted.
    Links are not timed on their own; a frame's time on them is in the end-to-end latency."""
    from .placement.cost import link_time

    e = svc.controller.workloads[name]
    prof = e.spec.profile
    if prof is None or not parts:
        return []
    devs = {d.id: d for d in svc.registry.fleet().devices}
    ids = [str(p["device"]) for p in sorted(parts, key=lambda p: p["index"])]
    if any(i not in devs for i in (e.spec.source, e.spec.sink, *ids)):
        return []
    report: dict[str, Any] = dict(svc.router.wire_reports.get((name, version, replica)) or {})
    cuts = {int(c["cut"]): int(c["wire_bytes"]) for c in report.get("cuts") or ()}
    spans = [tuple(p["segments"]) for p in sorted(parts, key=lambda p: p["index"])]
    out: list[dict[str, Any]] = []
    prev, nbytes = e.spec.source, float(prof.input_bytes)
    for k, (dev, (first, last)) in enumerate(zip(ids, spans)):
        if prev != dev:
            out.append({"stage": f"link {prev}->{dev}", "bytes_per_frame": int(nbytes),
                        "predicted_s": link_time(nbytes, devs[prev], devs[dev]), "measured_s": None})
        rec = svc.registry.devices.get(dev)
        ps = next((x for x in (rec.partitions() if rec is not None else ()) if
                   (x.workload, x.version, x.replica, x.index) == (name, version, replica, k)), None)
        out.append({"stage": f"compute {dev}",
                    "predicted_s": prof.compute_s(int(first), int(last), devs[dev]),
                    "measured_s": ps.p50_s if ps is not None and ps.served else None})
        # what crosses the cut: the bytes the fog's calibration measured on the chosen wire,
        # else what the scheduler charged (the profile's, on the expected wire)
        nbytes = float(cuts.get(k, prof.cut_bytes(int(last))))
        prev = dev
    if prev != e.spec.sink:
        out.append({"stage": f"link {prev}->{e.spec.sink}", "bytes_per_frame": int(nbytes),
                    "predicted_s": link_time(nbytes, devs[prev], devs[e.spec.sink]),
                    "measured_s": None})
    return out


def _bottleneck(stages: list[dict[str, Any]], key: str) -> str | None:
    timed = [s for s in stages if s[key] is not None]
    return max(timed, key=lambda s: s[key])["stage"] if timed else None


def _scaling(svc: FogService, name: str) -> dict[str, Any]:
    """Replicas wanted and running, the load the autoscaler sees and its last decisions (issue 33)."""
    c, core = svc.controller, svc.core
    e = c.workloads[name]
    now = time.monotonic()
    chains = c.chains(name)
    out: dict[str, Any] = {
        "replicas_wanted": c.wanted_replicas(name), "replicas_running": len(chains),
        "rate_fps": e.spec.rate_fps, "pending_reason": e.scale_reason or None,
        "draining": sorted(e.draining),
        "events": [{"age_s": round(now - t, 1), "from": d.current, "to": d.replicas, "reason": d.reason}
                   for t, d in core.autoscaler.events if d.workload == name][-5:],
        "scaled_up": core.autoscaler.counts.get((name, "up"), 0),
        "scaled_down": core.autoscaler.counts.get((name, "down"), 0),
    }
    if e.spec.rate_fps is not None:
        per_chain = core.chain_seconds(name)
        if per_chain > 0:
            reach = len(chains) / per_chain
            out["rate_reachable_fps"] = round(reach, 2)
            if reach < e.spec.rate_fps:
                out["rate_reason"] = (f"rate_fps {e.spec.rate_fps:g}: {len(chains)} chain(s) reach "
                                      f"{reach:.1f}/s" + (f"; {e.scale_reason}" if e.scale_reason else ""))
    return out


def _workload_row(svc: FogService, name: str, follows: str | None) -> dict[str, Any]:
    c = svc.controller
    e = c.workloads[name]
    reps: dict[int, list[dict[str, Any]]] = {}
    for a in c.assignments_of(name):
        reps.setdefault(a.replica, []).append({
            "index": a.index, "segments": [a.first, a.last], "device": a.device,
            "phase": a.phase.value, "attempts": a.attempts, "reason": a.reason or None})
    costs = dict(enumerate(e.replicas))
    stages = {r: _stages(svc, name, e.version, r, parts) for r, parts in reps.items()}
    # frames/s predicted on the wires in use (the scheduler's figure until the stages are known)
    top = max((s["predicted_s"] for s in stages.get(0, ())), default=0.0)
    pred_fps = 1.0 / top if top > 0 else (
        1.0 / e.replicas[0].bottleneck_s if e.replicas and e.replicas[0].bottleneck_s else None)
    predicted = min((r.latency_s for r in e.replicas if r.latency_s is not None), default=None)
    measured = svc.router.measured_p50(name)
    return {
        "name": name, "version": e.version, "status": e.status, "tenant": e.spec.tenant,
        "priority": e.spec.priority, "replicas": e.spec.replicas,
        "autoscale": e.spec.autoscale.to_dict() if e.spec.autoscale else None,  # the range; "scaling": where it is
        "follows": follows if follows and follows.startswith("release:") else None,
        "healthy_replicas": c.healthy_replicas(name), "model": e.spec.model,
        "switch": c.switch_view(name),  # a version change in progress: what serves, what drains
        "segments": len(e.spec.profile.segments) if e.spec.profile else None,
        # device classes (or devices) whose measured segment times the scheduler uses for it
        "measured_on": [k for k, _ in e.spec.profile.segment_times] if e.spec.profile else [],
        "placement": [{"replica": r, "partitions": parts,
                       "latency_s": costs[r].latency_s if r in costs else None,
                       "energy_j": costs[r].energy_j if r in costs else None,
                       # throughput workloads: the slowest stage; each cut's wire (issue 21)
                       "bottleneck_s": costs[r].bottleneck_s or None if r in costs else None,
                       "activations": svc.router.wire_reports.get((name, e.version, r)),
                       # each stage predicted against measured, and the slowest of each
                       "stages": stages[r], "bottleneck": _bottleneck(stages[r], "predicted_s"),
                       "measured_bottleneck": _bottleneck(stages[r], "measured_s")}
                      for r, parts in sorted(reps.items())],
        "scaling": _scaling(svc, name),
        "throughput": {"predicted_fps": pred_fps,
                       "measured_fps": svc.router.measured_fps(name, time.monotonic())},
        # what an autoscaler reads (issue 33): offered, goodput and shed per second over the last
        # 10 s, the chains' busy share, requests in flight, the deadline of a request without one
        "serving": {**{k: round(v, 3) if isinstance(v, float) else v for k, v in
                       asdict(svc.router.stats(name, c.chains(name), time.monotonic())).items()},
                    "slo_s": e.spec.slo_s},
        "reasons": dict(e.reasons), "evicted": name in c.evicted,
        # the plan's end-to-end latency (cost model, best replica) against what requests took
        "latency": {"predicted_s": predicted, "measured_p50_s": measured,
                    "error": None if predicted is None or not measured
                    else round((predicted - measured) / measured, 4)},
    }


def site_status(svc: FogService, now: float, *, offset: int = 0, limit: int | None = None) -> dict[str, Any]:
    """The status document; devices sorted by id, ``limit`` of them from ``offset``."""
    limit = DEFAULT_DEVICE_PAGE if limit is None else max(0, min(int(limit), MAX_DEVICE_PAGE))
    offset = max(0, int(offset))
    ids = sorted(svc.registry.devices)
    page = ids[offset:offset + limit]
    counts = svc.registry.counts()
    c = svc.controller
    pending = {d.device_id: d.state for d in svc.site.db.devices() if d.state != "approved"}
    # what each workload names as its model (``release:NAME``, ``zoo:NAME``, ``file:SHA``): the spec
    # resolves a release to the bytes it runs; this says which release it follows
    stored = {sw.name: str(sw.spec.get("model")) for sw in svc.store.workloads()}
    counters: Counter[str] = Counter(svc.counters)
    counters.update(svc.ingest.counts())
    counters.update({f"control.{k}": v for k, v in svc.control.counters.items()})
    counters.update({f"controller.{k}": v for k, v in c.counters.items()})
    counters.update({f"router.{k}": v for k, v in svc.router.counters.items()})
    counters.update({f"verifier.{k}": v for k, v in svc.ingest.rejections().items()})
    counters["registry.stale"] = svc.registry.stale
    counters["registry.rejected"] = svc.registry.rejected
    counters["registry.set_aside"] = svc.registry.set_aside
    counters["verifier.accepted"] = svc.ingest.verified()
    return {
        "fog_id": svc.config.fog_id, "site": svc.config.site, "epoch": svc.epoch,
        "secure": svc.config.tls is not None,
        "uptime_s": round(now - svc.started_mono, 3), "ready": c.ready,
        "devices": [_device_row(svc, d, now) for d in page],
        "devices_total": len(ids), "devices_offset": offset,
        "enrolment": {"pending": sorted(d for d, s in pending.items() if s == "pending"),
                      "revoked": sorted(d for d, s in pending.items() if s == "revoked")},
        "workloads": [_workload_row(svc, n, stored.get(n)) for n in sorted(c.workloads)],
        "metrics": {**{k: round(v, 4) for k, v in c.metrics.items()},
                    "devices_live": counts["live"], "devices_suspect": counts["suspect"],
                    "devices_dead": counts["dead"]},
        "quotas": {t: q.memory_bytes for t, q in c.quotas.items()},
        "releases": svc.releases.view(),
        # senders over their budget (ingest.py, control.py): quarantined ones with the reason
        "limits": {"devices": svc.ingest.limits(now), "control": svc.control.limits(now)},
        "counters": dict(sorted(counters.items())),
        "recoveries_s": [round(x, 4) for x in c.recoveries[-50:]],
        "events": list(svc.events)[-50:],  # oldest first: device lost / back, partition recovered
    }
