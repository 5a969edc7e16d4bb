"""Placement of several workloads: keep what runs, priority order, gang, quota, preemption.

Pipeline per workload (Kubernetes framework vocabulary): pre-filter (endpoints,
profile, quota), filter (the registered list ``plugins.filters``, each by its numpy
``batch``), score (``plugins.SCORE``: the workload's objective under the reference
model, optimised exactly per chain by its batch, ``chain.solve_chain``), permit (gang:
every replica or nothing), post-filter (preemption of the fewest lowest-priority
workloads). Why a workload is pending is each filter's own sentence.

Replicas: the primary chain is placed optimally; each further replica is placed
optimally on the devices whose power domain no earlier replica uses (stricter
than per-partition anti-affinity, so it holds whatever the replicas' cuts are).
"""
from __future__ import annotations

import itertools
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .chain import DeviceTable, min_segment_memory
from .cost import chain_cost
from .metrics import site_metrics
from .model import Fleet, Quota, Workload
from .plan import (
    PartitionPlacement,
    Plan,
    PlanMetrics,
    ReplicaPlacement,
    WorkloadPlacement,
    WorkloadResult,
)
from .plugins import (
    GATE_FIT,
    GATE_LATENCY,
    GATE_QUOTA,
    SCORE,
    Context,
    Filter,
    GangPermit,
    QuotaCheck,
    filters,
    first_failures,
    pending_reasons,
    unmeasured_leads,
)
from .spec import SpecError

__all__ = ["SchedulerConfig", "schedule"]


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Knobs of the scheduler; the defaults are what the fog broker runs."""

    battery_floor: float = 0.2
    preemption: bool = True
    #: Try all victim pairs (exact "fewest") up to this many candidates; beyond, greedy reprieve.
    preempt_pair_limit: int = 16
    #: Pairwise re-placement of same-priority new workloads, up to this many in a batch.
    improve_limit: int = 12
    bnb_node_limit: int = 200


@dataclass(slots=True)
class _Placed:
    workload: Workload
    replicas: tuple[ReplicaPlacement, ...]
    usage: list[tuple[int, float]]
    kept: bool = False

    @property
    def memory(self) -> float:
        return sum(b for _, b in self.usage)

    @property
    def objective(self) -> float:
        r = self.replicas[0]
        return SCORE.score(self.workload, r)


@dataclass(frozen=True, slots=True)
class _Failure:
    reasons: tuple[tuple[str, str], ...]
    detail: tuple[tuple[str, Any], ...]
    preemptible: bool


@dataclass(slots=True)
class _State:
    fleet: Fleet
    table: DeviceTable
    free: np.ndarray
    quotas: Mapping[str, Quota]
    cfg: SchedulerConfig
    tenant_used: dict[str, float] = field(default_factory=dict)
    placed: dict[str, _Placed] = field(default_factory=dict)

    def commit(self, p: _Placed) -> None:
        for dev, b in p.usage:
            self.free[dev] -= b
        t = p.workload.tenant
        self.tenant_used[t] = self.tenant_used.get(t, 0.0) + p.memory
        self.placed[p.workload.name] = p

    def release(self, name: str) -> _Placed:
        p = self.placed.pop(name)
        for dev, b in p.usage:
            self.free[dev] += b
        self.tenant_used[p.workload.tenant] -= p.memory
        return p

    def masks(self, w: Workload, fs: Sequence[Filter], free: np.ndarray,
              cached_only: bool = False) -> list[np.ndarray]:
        """Each filter's ``batch`` verdict over the snapshot (the fast path).

        A verdict that depends only on the immutable snapshot and the filter's ``key`` (the
        workload's spec, a knob) lives in ``fleet.cache``: shared by replicas, workloads with the
        same spec, and every reconcile on the same snapshot. ``cached_only``: just those.
        """
        out = []
        cache = self.fleet.cache
        for f in fs:
            k = f.key(w)
            if k is None:
                if not cached_only:
                    out.append(f.batch(w, self.fleet, free))
                continue
            ck = ("mask", f.name, k)
            hit = cache.get(ck)
            if hit is None:
                hit = cache[ck] = f.batch(w, self.fleet, free)
                hit.setflags(write=False)
            out.append(hit)
        return out

    def static(self, w: Workload, fs: Sequence[Filter],
               keys: Sequence[Hashable | None] | None = None) -> np.ndarray:
        """The devices every cacheable filter passes (their conjunction, cached as well).

        ``keys``: each filter's ``key(w)``, when the caller has them already."""
        ck = ("static", tuple(f.key(w) for f in fs) if keys is None else tuple(keys))
        ok: np.ndarray | None = self.fleet.cache.get(ck)
        if ok is None:
            ok = np.logical_and.reduce(self.masks(w, fs, self.free, cached_only=True))
            ok.setflags(write=False)
            self.fleet.cache[ck] = ok
        return ok

    def eligible(self, w: Workload, fs: Sequence[Filter], free: np.ndarray) -> np.ndarray:
        """The devices every filter passes: the static verdicts and those of the plan so far."""
        keys = [f.key(w) for f in fs]
        ok = self.static(w, fs, keys)
        for f, k in zip(fs, keys):
            if k is None:
                ok = ok & f.batch(w, self.fleet, free)
        return ok


def _profile_memory(w: Workload) -> float:
    assert w.profile is not None
    return w.profile.memory_of(0, len(w.profile.segments) - 1)


def _replica(w: Workload, st: _State, parts: Sequence[tuple[int, int, int]]) -> ReplicaPlacement:
    assert w.profile is not None
    ids = st.table.ids
    pp = tuple(PartitionPlacement(f, last, ids[z]) for f, last, z in parts)
    devs = {ids[z]: st.fleet.devices[z] for _, _, z in parts}
    devs[w.source] = st.fleet.devices[st.fleet.index[w.source]]
    devs[w.sink] = st.fleet.devices[st.fleet.index[w.sink]]
    c = chain_cost(w.profile, pp, devs, w.source, w.sink)
    return ReplicaPlacement(pp, c.latency_s, c.energy_j,
                            c.bottleneck_s if w.objective == "throughput" else 0.0)


def _attempt(w: Workload, st: _State) -> _Placed | _Failure:
    """Place every replica of ``w`` against the state's free memory, or explain why not.

    Nothing is committed: reservations live in a gang permit on a scratch copy.
    """
    fleet = st.fleet
    reasons: dict[str, str] = {}
    if w.profile is None:
        return _Failure((("model", f"model '{w.model}' has no chain profile (not loaded)"),),
                        (("model", w.model),), False)
    for role in ("source", "sink"):
        dev_id = getattr(w, role)
        if dev_id not in fleet.index:
            reasons[role] = f"{role} device '{dev_id}' is not in the fleet"
    if reasons:
        return _Failure(tuple(reasons.items()), (("source", w.source), ("sink", w.sink)), False)
    profile = w.profile
    min_total = _profile_memory(w) * w.replicas
    quota = st.quotas.get(w.tenant)
    used = st.tenant_used.get(w.tenant, 0.0)
    qs = QuotaCheck().check(w.tenant, min_total, used, quota)
    if not qs.ok:
        # Report every failed gate: also say whether it would fit the devices at all.
        assert quota is not None
        left = quota.memory_bytes - used
        qfail = _Failure(
            ((GATE_QUOTA, qs.reasons[0]),),
            (("tenant", w.tenant), ("quota_asked_bytes", min_total),
             ("quota_left_bytes", left)), False)
        fit = _attempt(w, _State(st.fleet, st.table, st.free, {}, st.cfg, {}, {}))
        if isinstance(fit, _Failure):
            return _Failure(qfail.reasons + fit.reasons, qfail.detail + fit.detail, False)
        return qfail
    min_seg = min_segment_memory(profile)
    src, snk = fleet.index[w.source], fleet.index[w.sink]
    scratch = st.free.copy()
    gang = GangPermit(scratch, w.replicas)
    taken: set[str] = set()
    replicas: list[ReplicaPlacement] = []
    usage: list[tuple[int, float]] = []
    limit = st.cfg.bnb_node_limit
    for r in range(w.replicas):
        # the first replica on measured devices; on unmeasured ones only when no measured one can
        for measured_lead in (True, False) if r == 0 and unmeasured_leads(fleet) else (True,):
            fs = filters(Context(st.cfg.battery_floor, r, frozenset(taken), min_seg, measured_lead))
            eligible = st.eligible(w, fs, scratch)
            sol = SCORE.batch(w, st.table, src, snk, free=scratch, eligible=eligible,
                              node_limit=limit)
            if sol is not None:
                break
        if sol is None:
            gang.unreserve()
            if w.max_latency_s is not None:  # is the bound what no chain meets?
                fast = SCORE.batch(w, st.table, src, snk, free=scratch, eligible=eligible,
                                   node_limit=limit, objective="latency", bounded=False)
                if fast is not None:
                    return _Failure(
                        ((GATE_LATENCY, f"no chain meets max_latency_s {w.max_latency_s:g} s: "
                                     f"the fastest takes {fast.value:.4g} s"),),
                        (("max_latency_s", w.max_latency_s), ("fastest_s", fast.value)), False)
            return _fit_failure(w, r, fs, st.masks(w, fs, scratch), scratch)
        for f, last, z in sol.parts:
            b = profile.memory_of(f, last)
            gang.reserve(z, b)
            usage.append((z, b))
            taken.add(fleet.devices[z].power_domain)
        replicas.append(_replica(w, st, sol.parts))
    if not gang.permit(len(replicas)).ok:  # pragma: no cover - loop above places all or returns
        gang.unreserve()
        raise AssertionError("gang permit after a full placement")
    asked = sum(b for _, b in usage)
    qs = QuotaCheck().check(w.tenant, asked, used, quota)
    if not qs.ok:
        assert quota is not None
        gang.unreserve()
        left = quota.memory_bytes - used
        return _Failure(
            ((GATE_QUOTA, qs.reasons[0]),),
            (("tenant", w.tenant), ("quota_asked_bytes", asked), ("quota_left_bytes", left)),
            False)
    gang.unreserve()  # the caller commits the placement against the real state
    return _Placed(w, tuple(replicas), usage)


def _fit_failure(w: Workload, replica: int, fs: Sequence[Filter], masks: Sequence[np.ndarray],
                 free: np.ndarray) -> _Failure:
    """Why no chain was found for ``replica``: each filter's sentence, and the numbers."""
    reasons, t = pending_reasons(fs, w, first_failures(masks), free, replica)
    need = _profile_memory(w)
    efree = t.free_eligible
    largest = float(efree.max()) if len(efree) else 0.0
    total_free = float(efree.sum()) if len(efree) else 0.0
    fragmented = t.fits > 0 and total_free >= need
    detail = (("devices", t.total), ("devices_fit", t.fits), ("histogram", dict(t.hist)),
              ("replica", replica), ("need_bytes", need), ("largest_free_bytes", largest),
              ("total_free_bytes", total_free), ("fragmented", fragmented))
    return _Failure(reasons, detail, True)


def _current_valid(w: Workload, pl: WorkloadPlacement, st: _State) -> _Placed | None:
    """The running placement if it is still valid on this snapshot, else None (re-place it)."""
    prof = w.profile
    fleet = st.fleet
    if prof is None or len(pl.replicas) != w.replicas or not pl.replicas:
        return None
    if w.source not in fleet.index or w.sink not in fleet.index:
        return None
    n = len(prof.segments)
    usage: list[tuple[int, float]] = []
    domains: list[set[str]] = []
    reps: list[ReplicaPlacement] = []
    ok: dict[bool, np.ndarray] = {}  # the snapshot's verdicts, for the first replica and the rest
    for r, rep in enumerate(pl.replicas):
        if (r > 0) not in ok:
            # what runs on a device not measured yet stays (it is measured as it loads)
            ok[r > 0] = st.static(w, filters(Context(st.cfg.battery_floor, r, measured_lead=False)))
        mask = ok[r > 0]
        nxt = 0
        seen: set[str] = set()
        ds: set[str] = set()
        if w.max_partitions is not None and len(rep.partitions) > w.max_partitions:
            return None
        if len(rep.partitions) < w.min_partitions:
            return None
        parts = []
        for p in rep.partitions:
            i = fleet.index.get(p.device)
            if i is None or not mask[i] or p.first != nxt or p.last < p.first or p.last >= n \
                    or p.device in seen:
                return None
            seen.add(p.device)
            ds.add(fleet.devices[i].power_domain)
            usage.append((i, prof.memory_of(p.first, p.last)))
            parts.append((p.first, p.last, i))
            nxt = p.last + 1
        if nxt != n:
            return None
        if any(ds & other for other in domains):
            return None
        domains.append(ds)
        reps.append(_replica(w, st, parts))
    need: dict[int, float] = {}
    for i, b in usage:
        need[i] = need.get(i, 0.0) + b
    if any(st.free[i] < b for i, b in need.items()):
        return None
    quota = st.quotas.get(w.tenant)
    if quota is not None and st.tenant_used.get(w.tenant, 0.0) + sum(need.values()) \
            > quota.memory_bytes:
        return None
    return _Placed(w, tuple(reps), usage, kept=True)


def _preempt(w: Workload, st: _State) -> tuple[_Placed, list[str]] | None:
    """Fewest lowest-priority victims that let ``w`` fit, and its placement; None if none do."""
    victims = sorted((p for p in st.placed.values() if p.workload.priority < w.priority),
                     key=lambda p: (p.workload.priority, -p.memory, p.workload.name))
    if not victims:
        return None
    names = [v.workload.name for v in victims]

    def trial(evict: Sequence[str]) -> _Placed | None:
        saved = [st.release(n) for n in evict]
        try:
            res = _attempt(w, st)
        finally:
            for p in saved:
                st.commit(p)
        return res if isinstance(res, _Placed) else None

    if trial(names) is None:
        return None
    for size in (1, 2):
        if size == 2 and len(names) > st.cfg.preempt_pair_limit:
            break
        for combo in itertools.combinations(names, size):
            res = trial(combo)
            if res is not None:
                return res, list(combo)
    # Greedy reprieve (Kubernetes style): evict all, then spare the highest priority first.
    chosen = list(names)
    for n in reversed(names):
        rest = [x for x in chosen if x != n]
        if trial(rest) is not None:
            chosen = rest
    res = trial(chosen)
    assert res is not None
    return res, chosen


def _improve(st: _State, batch: list[str]) -> None:
    """Pairwise re-placement of new same-priority workloads in the other order, if it is cheaper."""
    if len(batch) < 2 or len(batch) > st.cfg.improve_limit:
        return
    changed = True
    rounds = 0
    while changed and rounds < 3:
        changed = False
        rounds += 1
        for a, b in itertools.combinations(batch, 2):
            pa, pb = st.placed.get(a), st.placed.get(b)
            if pa is None or pb is None or pa.workload.priority != pb.workload.priority:
                continue
            before = pa.objective + pb.objective
            st.release(a)
            st.release(b)
            nb = _attempt(pb.workload, st)
            ok = False
            if isinstance(nb, _Placed):
                st.commit(nb)
                na = _attempt(pa.workload, st)
                if isinstance(na, _Placed) and na.objective + nb.objective < before * (1 - 1e-9):
                    st.commit(na)
                    ok = True
                else:
                    st.release(b)
            if not ok:
                st.commit(pa)
                st.commit(pb)
            changed |= ok


def schedule(fleet: Fleet, workloads: Sequence[Workload],
             current: Mapping[str, WorkloadPlacement] | None = None,
             quotas: Mapping[str, Quota] | None = None,
             config: SchedulerConfig | None = None) -> Plan:
    """Plan every workload on ``fleet``: keep valid ``current`` placements, place the rest.

    Pure: no clock (``metrics.solve_s`` is 0 here; the shell fills it in), no randomness.
    """
    cfg = config or SchedulerConfig()
    current = current or {}
    table = fleet.cache.get("table")
    if table is None:  # the snapshot is immutable, so its columns are built once
        table = fleet.cache["table"] = DeviceTable.from_devices(fleet.devices)
    st = _State(fleet, table, table.memory.copy(), quotas or {}, cfg)
    names = [w.name for w in workloads]
    if len(set(names)) != len(names):
        raise SpecError("duplicate workload names")

    def size(w: Workload) -> float:
        return _profile_memory(w) * w.replicas if w.profile is not None else 0.0

    order = sorted(workloads, key=lambda w: (-w.priority, -size(w), w.name))
    # 1. Keep what runs and is still valid (higher priority keeps first if memory shrank).
    for w in order:
        pl = current.get(w.name)
        if pl is not None:
            kept = _current_valid(w, pl, st)
            if kept is not None:
                st.commit(kept)
    # 2. Place the rest in priority order, preempting lower priority work when that helps.
    failures: dict[str, _Failure] = {}
    evicted: list[str] = []
    new: list[str] = []
    for w in order:
        if w.name in st.placed or w.name in failures:  # placed, or evicted and re-tried already
            continue
        res = _attempt(w, st)
        if isinstance(res, _Placed):
            st.commit(res)
            new.append(w.name)
            continue
        if cfg.preemption and res.preemptible:
            pre = _preempt(w, st)
            if pre is not None:
                placed, victims = pre
                gone = [st.release(v) for v in victims]
                st.commit(placed)
                new.append(w.name)
                evicted.extend(victims)
                for v in sorted(gone, key=lambda p: (-p.workload.priority, p.workload.name)):
                    again = _attempt(v.workload, st)
                    if isinstance(again, _Placed):
                        st.commit(again)
                        new.append(v.workload.name)
                        failures.pop(v.workload.name, None)
                    else:
                        failures[v.workload.name] = _Failure(
                            again.reasons + (("preempted", f"evicted by higher-priority "
                                                           f"workload {w.name}"),),
                            again.detail + (("evicted_by", w.name),), again.preemptible)
                continue
        failures[w.name] = res
    # 3. Same-priority new placements: pairwise swaps that lower the summed objective.
    by_prio: dict[int, list[str]] = {}
    for name in new:
        if name in st.placed:
            by_prio.setdefault(st.placed[name].workload.priority, []).append(name)
    for group in by_prio.values():
        _improve(st, group)
    # 4. Results in input order, metrics over the committed memory.
    results = []
    for w in workloads:
        p = st.placed.get(w.name)
        if p is not None:
            results.append(WorkloadResult(w.name, "placed", p.replicas, kept=p.kept))
        else:
            f = failures.get(w.name) or _Failure(((GATE_FIT, "not placed"),), (), False)
            results.append(WorkloadResult(w.name, "pending", (), f.reasons, f.detail))
    used: dict[str, float] = {}
    for p in st.placed.values():
        for i, b in p.usage:
            used[fleet.devices[i].id] = used.get(fleet.devices[i].id, 0.0) + b
    util, frag = site_metrics(fleet, used)
    return Plan(tuple(results), tuple(dict.fromkeys(evicted)), PlanMetrics(util, frag))

