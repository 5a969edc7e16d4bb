"""One site's state as a frozen value: what status, metrics, the HTTP API, control and the site page read.

``SiteCore.snapshot(now)`` builds a ``SiteSnapshot`` on the thread that drives the core (the
fog's owner thread, the simulation's loop) from the registry, the controller, the router, the
autoscaler and the slow-stage book; nothing in it refers back to them (dicts are read-only
mappings, lists are tuples), so any thread may read it while the core moves on. The front ends
never see the cores themselves: a new status field is one line here and, if it needs shell
facts, one in ``status``.

Nothing here does I/O or reads a clock; ``now`` is the core's monotonic time.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from .placement.cost import link_time
from .registry import capacity_flags

if TYPE_CHECKING:
    from .site_core import SiteCore

__all__ = ["SiteSnapshot", "WorkloadRow", "PartitionRow", "counter_copy", "freeze", "thaw", "build"]

_EMPTY: Mapping[str, Any] = MappingProxyType({})


def _empty() -> Any:
    return _EMPTY


def freeze(obj: Any) -> Any:
    """A read-only copy: dicts -> ``MappingProxyType`` over a fresh dict, lists/tuples/sets -> tuples."""
    if isinstance(obj, Mapping):
        return MappingProxyType({k: freeze(v) for k, v in obj.items()})
    if isinstance(obj, (list, tuple, set, frozenset)):
        return tuple(freeze(v) for v in obj)
    return obj


def thaw(obj: Any) -> Any:
    """Plain JSON-shaped data again (mappings -> dicts, tuples -> lists) for a document to hand out."""
    if isinstance(obj, Mapping):
        return {k: thaw(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [thaw(v) for v in obj]
    return obj


@dataclass(frozen=True, slots=True)
class PartitionRow:
    """One placed partition: where it runs and in which phase."""
    workload: str
    version: int
    replica: int
    index: int
    device: str
    first: int
    last: int
    phase: str
    attempts: int
    reason: str


@dataclass(frozen=True, slots=True)
class WorkloadRow:
    """One workload as the front ends see it; ``doc`` is its row of the status document."""
    name: str
    version: int
    status: str
    model: str | None
    input_shapes: tuple[tuple[str, tuple[int, ...]], ...]
    slo_s: float | None
    reasons: tuple[tuple[str, str], ...]
    chains: int                          # replica chains a request can be routed to now
    scaling: Mapping[str, Any] = field(default_factory=_empty)
    doc: Mapping[str, Any] = field(default_factory=_empty)

    @property
    def ready(self) -> bool:
        return self.chains > 0

    def why_not_ready(self) -> str:
        """Why it does not serve (ask when it is not ``ready``): the gates first, else its status."""
        if self.reasons:
            return "; ".join(f"{k}: {v}" for k, v in self.reasons)
        return f"status {self.status}, no healthy replica chain yet"


@dataclass(frozen=True, slots=True)
class SiteSnapshot:
    """The site at ``at`` (monotonic): immutable, safe to read on any thread."""
    at: float = 0.0
    generation: int = -1                 # the core's event count when it was built
    ready: bool = False
    workloads: tuple[WorkloadRow, ...] = ()          # by name
    devices: tuple[Mapping[str, Any], ...] = ()      # status rows, by id
    partitions: tuple[PartitionRow, ...] = ()
    device_counts: Mapping[str, int] = field(default_factory=_empty)        # live, suspect, dead, unknown
    counters: Mapping[str, int] = field(default_factory=_empty)             # the site's own (the shell counts too)
    core_counters: Mapping[str, int] = field(default_factory=_empty)        # controller.*, router.*, registry.*
    flags: Mapping[str, tuple[str, ...]] = field(default_factory=_empty)    # device -> implausible claims in its birth
    metrics: Mapping[str, float] = field(default_factory=_empty)            # utilization, fragmentation
    quotas: Mapping[str, int] = field(default_factory=_empty)               # tenant -> memory bytes
    recoveries_s: tuple[float, ...] = ()             # every one (status shows the last 50)
    in_flight: int = 0                               # inference requests routed, not answered
    latency: Mapping[str, Mapping[str, Any]] = field(default_factory=_empty)  # workload -> {bounds, counts, sum}
    releases: Mapping[str, Mapping[str, Any]] = field(default_factory=_empty)  # name -> {version, model, signer, ...}
    _by_name: Mapping[str, WorkloadRow] = field(default_factory=_empty, repr=False, compare=False)

    def workload(self, name: str) -> WorkloadRow | None:
        return self._by_name.get(name)


# ------------------------------------------------------------------ building (the core's thread)


def _device_row(core: SiteCore, did: str, now: float) -> dict[str, Any]:
    rec = core.registry.devices[did]
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
        "slow": core.slow_stages.reason_of(did),
        "partitions": [f"{p.workload}/v{p.version}/r{p.replica}/p{p.index}:{p.health}" for p in rec.partitions()],
    }


def _stages(core: SiteCore, devs: Mapping[str, Any], name: str, version: int, replica: int,
            parts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A chain's pipeline stages in order (``placement.cost.stage_times``): each partition's
    compute, predicted on its device and measured (the p50 its device reports), and each link a
    frame crosses with the bytes per frame on its wire and the serialisation time predicted.
    Links are not timed on their own; a frame's time on them is in the end-to-end latency."""
    e = core.controller.workloads[name]
    prof = e.spec.profile
    if prof is None or not parts:
        return []
    ids = [str(p["device"]) for p in sorted(parts, key=lambda p: p["index"])]
    if any(i not in devs for i in (e.spec.source, e.spec.sink, *ids)):
        return []
    report: dict[str, Any] = dict(core.router.wire_reports.get((name, version, replica)) or {})
    cuts = {int(c["cut"]): int(c["wire_bytes"]) for c in report.get("cuts") or ()}
    spans = [tuple(p["segments"]) for p in sorted(parts, key=lambda p: p["index"])]
    out: list[dict[str, Any]] = []
    prev, nbytes = e.spec.source, float(prof.input_bytes)
    for k, (dev, (first, last)) in enumerate(zip(ids, spans)):
        if prev != dev:
            out.append({"stage": f"link {prev}->{dev}", "bytes_per_frame": int(nbytes),
                        "predicted_s": link_time(nbytes, devs[prev], devs[dev]), "measured_s": None})
        rec = core.registry.devices.get(dev)
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


def _scaling(core: SiteCore, name: str, now: float) -> dict[str, Any]:
    """Replicas wanted and running, the load the autoscaler sees and its last decisions (issue 33)."""
    c = core.controller
    e = c.workloads[name]
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


def _workload(core: SiteCore, devs: Mapping[str, Any], name: str, now: float) -> WorkloadRow:
    c, router = core.controller, core.router
    e = c.workloads[name]
    reps: dict[int, list[dict[str, Any]]] = {}
    for a in c.assignments_of(name):
        reps.setdefault(a.replica, []).append({
            "index": a.index, "segments": [a.first, a.last], "device": a.device,
            "phase": a.phase.value, "attempts": a.attempts, "reason": a.reason or None})
    costs = dict(enumerate(e.replicas))
    stages = {r: _stages(core, devs, name, e.version, r, parts) for r, parts in reps.items()}
    # frames/s predicted on the wires in use (the scheduler's figure until the stages are known)
    top = max((s["predicted_s"] for s in stages.get(0, ())), default=0.0)
    pred_fps = 1.0 / top if top > 0 else (
        1.0 / e.replicas[0].bottleneck_s if e.replicas and e.replicas[0].bottleneck_s else None)
    predicted = min((r.latency_s for r in e.replicas if r.latency_s is not None), default=None)
    measured = router.measured_p50(name)
    chains = c.chains(name)
    scaling = _scaling(core, name, now)
    doc = {
        "name": name, "version": e.version, "status": e.status, "tenant": e.spec.tenant,
        "priority": e.spec.priority, "replicas": e.spec.replicas,
        "autoscale": e.spec.autoscale.to_dict() if e.spec.autoscale else None,  # the range; "scaling": where it is
        # the release it follows (its model is ``release:NAME``; ``model`` is what that resolved to)
        "follows": f"release:{core.follows[name]}" if name in core.follows else None,
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
                       "activations": router.wire_reports.get((name, e.version, r)),
                       # each stage predicted against measured, and the slowest of each
                       "stages": stages[r], "bottleneck": _bottleneck(stages[r], "predicted_s"),
                       "measured_bottleneck": _bottleneck(stages[r], "measured_s")}
                      for r, parts in sorted(reps.items())],
        "scaling": scaling,
        "throughput": {"predicted_fps": pred_fps, "measured_fps": router.measured_fps(name, now)},
        # what an autoscaler reads (issue 33): offered, goodput and shed per second over the last
        # 10 s, the chains' busy share, requests in flight, the deadline of a request without one
        "serving": {**{k: round(v, 3) if isinstance(v, float) else v for k, v in
                       asdict(router.stats(name, chains, now)).items()},
                    "slo_s": e.spec.slo_s},
        "reasons": dict(e.reasons), "evicted": name in c.evicted,
        # the plan's end-to-end latency (cost model, best replica) against what requests took
        "latency": {"predicted_s": predicted, "measured_p50_s": measured,
                    "error": None if predicted is None or not measured
                    else round((predicted - measured) / measured, 4)},
    }
    return WorkloadRow(name, int(e.version), str(e.status), e.spec.model,
                       tuple((str(n), tuple(s)) for n, s in e.spec.input_shapes), e.spec.slo_s,
                       tuple((str(k), str(v)) for k, v in e.reasons.items()), len(chains),
                       freeze(scaling), freeze(doc))


def counter_copy(c: Mapping[str, int]) -> dict[str, int]:
    """A copy of a counter another thread may be adding a key to (the shell's threads count there)."""
    for _ in range(5):
        try:
            return {str(k): int(v) for k, v in dict(c).items()}
        except RuntimeError:  # "dictionary changed size during iteration"
            continue
    return {}


def _core_counters(core: SiteCore) -> dict[str, int]:
    out: dict[str, int] = {}
    reg = core.registry
    out.update({f"controller.{k}": v for k, v in core.controller.counters.items()})
    out.update({f"router.{k}": v for k, v in core.router.counters.items()})
    out["registry.stale"] = reg.stale
    out["registry.rejected"] = reg.rejected
    out["registry.set_aside"] = reg.set_aside
    return out


def _partitions(core: SiteCore, names: Iterable[str]) -> tuple[PartitionRow, ...]:
    return tuple(PartitionRow(a.key[0], a.key[1], a.key[2], a.key[3], a.device, a.first, a.last, a.phase.value,
                              a.attempts, a.reason or "")
                 for n in names for a in core.controller.assignments_of(n))


def build(core: SiteCore, now: float, generation: int,
          releases: Mapping[str, Mapping[str, Any]] | None = None) -> SiteSnapshot:
    """The snapshot of ``core`` at ``now`` (on the thread that drives it)."""
    c = core.controller
    reg = core.registry
    names = sorted(c.workloads)
    devs = {d.id: d for d in reg.fleet().devices} if names else {}
    rows = tuple(_workload(core, devs, n, now) for n in names)
    latency = {w: {"bounds": tuple(h.bounds), "counts": tuple(h.counts), "sum": float(h.total_s)}
               for w, h in core.router.latency_histograms.items()}
    return SiteSnapshot(
        at=now, generation=generation, ready=bool(c.ready), workloads=rows,
        devices=tuple(freeze(_device_row(core, d, now)) for d in sorted(reg.devices)),
        partitions=_partitions(core, names),
        device_counts=freeze(reg.counts()), counters=freeze(counter_copy(core.counters)),
        core_counters=freeze(_core_counters(core)),
        flags=freeze(core.flags), metrics=freeze(dict(c.metrics)),
        quotas=freeze({t: q.memory_bytes for t, q in c.quotas.items()}),
        recoveries_s=tuple(float(x) for x in c.recoveries), in_flight=len(core.router),
        latency=freeze(latency), releases=freeze(releases or {}),
        _by_name=MappingProxyType({r.name: r for r in rows}))
