"""An independent checker of plans: hard constraints and reported costs.

Deliberately shares no code with the optimiser (it re-derives memory and costs
from the raw JSON-level objects), so tests and benchmarks can trust its verdict.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

from .model import Device, Fleet, Quota, Workload
from .plan import Plan

__all__ = ["validate_plan"]


def _lbl_domain(d: Device) -> str:
    labels = dict(d.labels)
    return labels.get("power-domain", f"device:{d.id}")


def _transfer(b: float, a: Device, z: Device) -> tuple[float, float]:
    if a.id == z.id:
        return 0.0, 0.0
    t = (a.rtt_s + z.rtt_s) / 2 + 8 * b / min(a.uplink_bps, z.downlink_bps)
    return t, b * a.tx_j_per_byte + b * z.rx_j_per_byte


def _measured(times: Sequence[tuple[str, Sequence[float]]], d: Device
              ) -> Sequence[float] | None:
    """COST_MODEL.md: measured seconds for this device (its id first, then ``class:NAME``, then NAME)."""
    labels = dict(d.labels)
    cls = labels.get("device-class") or labels.get("device-model")
    by_id = [t for k, t in times if k == d.id]
    if by_id:
        return by_id[0]
    for key in ((f"class:{cls}", cls) if cls else ()):  # the fog's class times, then a plain key
        by_cls = [t for k, t in times if k == key]
        if by_cls:
            return by_cls[0]
    return None


def validate_plan(plan: Plan, fleet: Fleet, workloads: Sequence[Workload],
                  quotas: Mapping[str, Quota] | None = None, *, battery_floor: float = 0.2,
                  rel_tol: float = 1e-6) -> list[str]:
    """Every hard-constraint violation in ``plan`` as a sentence; empty when the plan is valid."""
    errs: list[str] = []
    devs = {d.id: d for d in fleet.devices}
    wl = {w.name: w for w in workloads}
    used: dict[str, float] = {}
    tenant: dict[str, float] = {}
    names = [r.name for r in plan.workloads]
    if sorted(names) != sorted(wl):
        errs.append("plan does not list every workload exactly once")
    for r in plan.workloads:
        w = wl.get(r.name)
        if w is None or r.status != "placed":
            if r.status == "pending" and not r.reasons:
                errs.append(f"{r.name}: pending without a reason")
            continue
        prof = w.profile
        if prof is None:
            errs.append(f"{w.name}: placed without a profile")
            continue
        segs = prof.segments
        n = len(segs)
        if len(r.replicas) != w.replicas:
            errs.append(f"{w.name}: {len(r.replicas)} replicas placed, {w.replicas} asked (gang)")
        seg_domains: list[dict[int, str]] = []
        for k, rep in enumerate(r.replicas):
            where = f"{w.name} replica {k}"
            if w.max_partitions is not None and len(rep.partitions) > w.max_partitions:
                errs.append(f"{where}: {len(rep.partitions)} partitions > max_partitions")
            if len(rep.partitions) < w.min_partitions:
                errs.append(f"{where}: {len(rep.partitions)} partitions < min_partitions")
            nxt = 0
            chain_devs: list[str] = []
            doms: dict[int, str] = {}
            src, snk = devs.get(w.source), devs.get(w.sink)
            if src is None or snk is None:
                errs.append(f"{where}: unknown source or sink")
                continue
            prev, b, lat, en = src, prof.input_bytes, 0.0, 0.0
            for p in rep.partitions:
                d = devs.get(p.device)
                if d is None:
                    errs.append(f"{where}: unknown device {p.device}")
                    break
                if p.first != nxt or p.last < p.first or p.last >= n:
                    errs.append(f"{where}: partitions do not tile the segments in order")
                    break
                nxt = p.last + 1
                if not d.alive:
                    errs.append(f"{where}: device {d.id} not alive")
                if k == 0 and not d.verified:
                    errs.append(f"{where}: device {d.id} has a flagged capacity claim")
                labels = dict(d.labels)
                if any(labels.get(k2) != v for k2, v in w.selectors):
                    errs.append(f"{where}: device {d.id} fails the selectors")
                for taint in d.taints:
                    if taint.effect in ("NoSchedule", "NoExecute") and not any(
                            tol.key == taint.key and tol.value in ("", taint.value)
                            and tol.effect in ("", taint.effect) for tol in w.tolerations):
                        errs.append(f"{where}: device {d.id} has an untolerated taint")
                if d.battery is not None and not d.battery.charging \
                        and d.battery.level < battery_floor:
                    errs.append(f"{where}: device {d.id} battery below floor")
                chain_devs.append(d.id)
                mem = sum(s.param_bytes for s in segs[p.first:p.last + 1]) + max(
                    s.activation_bytes for s in segs[p.first:p.last + 1])
                used[d.id] = used.get(d.id, 0.0) + mem
                tenant[w.tenant] = tenant.get(w.tenant, 0.0) + mem
                for s in range(p.first, p.last + 1):
                    doms[s] = _lbl_domain(d)
                if w.providers and not any(x in (d.providers or ("CPUExecutionProvider",))
                                           for x in w.providers):
                    errs.append(f"{where}: device {d.id} offers none of the providers "
                                f"{','.join(w.providers)}")
                t, e = _transfer(b, prev, d)
                measured = _measured(prof.segment_times, d)
                if measured is not None:
                    c = sum(measured[p.first:p.last + 1])
                else:
                    c = sum(s.flops for s in segs[p.first:p.last + 1]) / d.flops
                lat += t + c
                en += e + (d.power_active_w * c if d.power_active_w > 0 else 0.0)
                b, prev = segs[p.last].out_bytes, d
            else:
                if nxt != n:
                    errs.append(f"{where}: segments {nxt}..{n - 1} not placed")
                t, e = _transfer(b, prev, snk)
                lat += t
                en += e
                for got, want, what in ((rep.latency_s, lat, "latency_s"),
                                        (rep.energy_j, en, "energy_j")):
                    if abs(got - want) > rel_tol * max(abs(want), 1e-12):
                        errs.append(f"{where}: reported {what} {got} but the model gives {want}")
            if len(set(chain_devs)) != len(chain_devs):
                errs.append(f"{where}: chain visits a device twice")
            seg_domains.append(doms)
        if w.replicas > 1:
            for s in range(n):
                ds = [d[s] for d in seg_domains if s in d]
                if len(set(ds)) != len(ds):
                    errs.append(f"{w.name}: replicas of segment {s} share a power domain")
                    break
    for did, u in used.items():
        if u > devs[did].memory_bytes * (1 + 1e-12):
            errs.append(f"device {did}: {u:.0f} bytes placed, {devs[did].memory_bytes:.0f} available")
    for name, u in tenant.items():
        q = (quotas or {}).get(name)
        if q is not None and u > q.memory_bytes * (1 + 1e-12):
            errs.append(f"tenant {name}: {u:.0f} bytes placed over quota {q.memory_bytes:.0f}")
    return errs
