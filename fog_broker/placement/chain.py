"""Exact optimiser for one replica chain under the reference cost model.

Why it is exact
---------------
Let a *relaxed chain* be a chain of partitions in which two consecutive
partitions never share a device, but a device may be revisited later, and each
partition only has to fit its device's free memory on its own. Every feasible
chain (each device at most once) is a relaxed chain with the same cost, so the
relaxed optimum is a lower bound. The relaxed optimum is found exactly by a DP
over (segment boundary, partitions used, last device): ``A[j]`` is the cheapest
way to have segments ``0..j-1`` done and their output arriving at device ``d``
(from a *different* device), ``V[j']`` the cheapest way to also run segments
``j..j'-1`` on ``d``. The min over predecessor devices is vectorised: with
``u = 1/uplink`` sorted, ``8b/min(up_a, down_d) = 8b*max(u_a, 1/down_d)`` splits
into a prefix min and a suffix min, so a boundary costs O(D log D), not O(D^2);
the predecessor equal to ``d`` is excluded exactly by re-running the sweep for
the few ``d`` that are their own argmin. No device is dropped except by filters
and memory, so nothing is lost by pruning.

If the relaxed optimum is a feasible chain, it is optimal. Otherwise some
device ``d`` hosts two partitions, the first ending at segment ``m-1``. Placing
two consecutive partitions on one device is never better than merging them
(same compute, no transfer, less memory, fewer partitions), so some optimal
chain uses ``d`` for at most one partition ``P``, and then exactly one holds:
``P`` ends before ``m``; ``P`` starts at or after ``m``; or ``P`` contains
``m-1`` and ``m``. Each branch restricts the partitions ``d`` may host, and
excludes the current relaxed solution. Best-first branch and bound over these
branches terminates (ranges only shrink) and returns the optimum; a node limit
(rarely reached) returns the best feasible chain with ``exact=False``.
A lower bound on the partition count (``min_partitions``) changes nothing in
this argument: the DP tracks the count exactly (row ``r`` = ``r + 1``
partitions so far) and only rows ``>= min_partitions - 1`` may end the chain,
so the relaxation still contains every feasible chain with an allowed count,
and the branches above never merge or split partitions.

Dominance pruning (exact)
-------------------------
Before the DP, devices that provably cannot improve the optimum are dropped.
Write ``s(d)`` for the static cost vector of ``d`` under the objective
(latency: ``flops`` up, ``rtt`` down, ``uplink`` up, ``downlink`` up; energy:
``power_active/flops``, ``tx``, ``rx``, all down) and ``q(d)`` for its free
memory rounded down to the largest partition memory of this profile that fits
(``q(d) >= q(a)`` iff ``d`` can hold every partition ``a`` can). Device ``a``
*dominates* ``d`` (``a > d``) when ``s(a)`` is no worse than ``s(d)`` in every
component, ``q(a) >= q(d)``, and the two vectors differ or ``a`` has the
smaller index: a strict partial order.

1. Swap. Let a feasible chain with ``k <= P`` partitions (``P`` = the most
   partitions allowed) use ``d``, and let ``a > d`` be a candidate device not
   in the chain. Put ``d``'s partition on ``a`` instead. The partition fits
   (its memory ``<= q(d) <= q(a)``), the chain still visits each device once,
   compute is no slower (no costlier), and every transfer into or out of it
   is no worse: for an endpoint ``x != d`` (the chain neighbours, the source,
   the sink), ``transfer(x, a) <= transfer(x, d)`` term by term (``rtt``,
   ``max(1/up_x, 1/down)``, ``rx``), and it is 0 when ``x == a``. The swap
   needs ``d`` to be neither source nor sink (their own transfer is 0), so
   those are never pruned.
2. Counting. If ``d`` has at least ``P`` candidate dominators, at most
   ``k - 1 <= P - 1`` of them are in the chain, so one is free for the swap.
3. Termination. ``a > d`` implies ``dom(a)`` is a strict subset of ``dom(d)``
   (transitivity, irreflexivity), so repeating the swap on any pruned device
   left in the chain strictly lowers ``sum |dom(.)|`` and stops with a chain
   of kept devices that costs no more. Hence the optimum over kept devices
   equals the optimum over all candidates, with the same partition count.

Only the ``DOMINATOR_LIST`` dominators with the most memory are remembered
per device (built once per table); counting fewer dominators prunes less and
never breaks the argument.

``P`` is usually much smaller than the segment count: when one partition is
allowed, ``chain_length_bound`` compares a lower bound on any ``k``-partition
chain with the best one-device chain (a feasible upper bound) and returns the
largest ``k`` that can still win; every longer chain costs strictly more than
that upper bound, so an optimal chain has at most that many partitions, and
the swap argument needs only that many dominators. When the bound is 1 the
best one-device chain is the optimum and no DP runs at all.
"""
from __future__ import annotations

import functools
import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .model import ChainProfile, Device, measured_times

__all__ = ["DeviceTable", "ChainSolution", "solve_chain", "min_segment_memory", "kept_devices"]

INF = float("inf")
#: Dominators remembered per device (most memory first); more prune more, at O(D*L) per solve.
DOMINATOR_LIST = 32
_BLOCK = 512


@dataclass(frozen=True, slots=True)
class DeviceTable:
    """Device parameters as numpy columns, built once per fleet snapshot."""

    ids: tuple[str, ...]
    flops: np.ndarray
    memory: np.ndarray
    up: np.ndarray
    down: np.ndarray
    rtt: np.ndarray
    pact: np.ndarray
    tx: np.ndarray
    rx: np.ndarray
    #: Each device's class (``Device.device_class``): measured segment times are keyed by it.
    classes: tuple[str, ...] = ()
    #: Derived data of this immutable table (dominator lists), built on first use.
    cache: dict[Any, Any] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_devices(cls, devices: Sequence[Device]) -> DeviceTable:
        def col(name: str) -> np.ndarray:
            return np.array([getattr(d, name) for d in devices], dtype=np.float64)
        return cls(tuple(d.id for d in devices), col("flops"), col("memory_bytes"),
                   col("uplink_bps"), col("downlink_bps"), col("rtt_s"),
                   col("power_active_w"), col("tx_j_per_byte"), col("rx_j_per_byte"),
                   tuple(d.device_class for d in devices))

    def __len__(self) -> int:
        return len(self.ids)


@dataclass(frozen=True, slots=True)
class ChainSolution:
    """Partitions as ``(first, last, device index into the table)``, the objective value."""

    parts: tuple[tuple[int, int, int], ...]
    value: float
    exact: bool
    nodes: int


def min_segment_memory(profile: ChainProfile) -> float:
    """No partition needs less than this; a device with less free memory can host nothing."""
    return min(s.param_bytes + s.activation_bytes for s in profile.segments)


def _static_keys(table: DeviceTable, objective: str, T: np.ndarray | None = None) -> np.ndarray:
    """The static cost components of every device, oriented so that bigger is better.

    With measured segment times ``T`` (segments x devices) the compute component is one
    row per segment (no slower on every segment), which is what the swap argument needs.
    """
    if objective == "energy":
        with np.errstate(over="ignore", divide="ignore"):  # at the ranges' edges the cost is inf
            compute = [-(table.pact / table.flops)] if T is None else list(-(T * table.pact))
        return np.stack([*compute, -table.tx, -table.rx])
    compute = [table.flops] if T is None else list(-T)
    return np.stack([*compute, -table.rtt, table.up, table.down])


def _dominator_lists(table: DeviceTable, objective: str, profile: ChainProfile | None = None
                     ) -> tuple[np.ndarray, np.ndarray]:
    """Per device, up to ``DOMINATOR_LIST`` statically dominating devices, most memory first.

    Returns ``dom`` (D x L indices, padded with ``D``) and ``weak`` (the pair's static vectors
    are equal and the dominator has the larger index, so it dominates only with strictly more
    memory). Built once per table and objective (and per profile, when measured segment
    times apply), in column blocks so memory stays O(D * block).
    """
    T = None if profile is None else _ProfileArrays.of(table, profile).T
    key: tuple[Any, ...] = ("dominators", objective) if T is None else \
        ("dominators", objective, id(profile))
    hit = table.cache.get(key)
    if hit is not None and (T is None or hit[2] is profile):
        return hit[0], hit[1]
    V = _static_keys(table, objective, T)
    D = len(table)
    L = max(0, min(DOMINATOR_LIST, D - 1))
    dom = np.full((D, L), D, dtype=np.intp)
    weak = np.zeros((D, L), dtype=bool)
    order = np.argsort(-table.memory, kind="stable")  # rows: candidate dominators, most memory first
    inv = np.empty(D, dtype=np.intp)
    inv[order] = np.arange(D)
    Vo = np.ascontiguousarray(V[:, order])
    for lo in range(0, D if L else 0, _BLOCK):
        cols = np.arange(lo, min(D, lo + _BLOCK))
        # ge[c, i]: device order[i] is no worse than device cols[c] in every static component.
        ge = V[0, cols][:, None] <= Vo[0][None, :]
        for k in range(1, V.shape[0]):
            ge &= V[k, cols][:, None] <= Vo[k][None, :]
        ge[np.arange(len(cols)), inv[cols]] = False  # a device does not dominate itself
        take = ge & (np.cumsum(ge, axis=1, dtype=np.int32) <= L)
        c_idx, r_idx = np.nonzero(take)  # grouped by device, most memory first within
        cnt = np.count_nonzero(take, axis=1)
        start = np.concatenate(([0], np.cumsum(cnt)[:-1]))
        pos = np.arange(len(c_idx)) - start[c_idx]
        a_idx, d_idx = order[r_idx], cols[c_idx]
        dom[d_idx, pos] = a_idx
        weak[d_idx, pos] = (V[:, a_idx] == V[:, d_idx]).all(axis=0) & (a_idx > d_idx)
    table.cache[key] = (dom, weak, profile)
    return dom, weak


def _partition_memories(profile: ChainProfile) -> np.ndarray:
    """``MEM[i, j]`` = memory of the partition of segments ``i..j``; INF below the diagonal."""
    segs = profile.segments
    n = len(segs)
    pb = np.array([s.param_bytes for s in segs])
    act = np.array([s.activation_bytes for s in segs])
    cpb = np.concatenate(([0.0], np.cumsum(pb)))
    MEM: np.ndarray = cpb[None, 1:] - cpb[:-1, None]
    peak = np.full((n, n), -INF)
    for i in range(n):
        peak[i, i:] = np.maximum.accumulate(act[i:])
    MEM = MEM + peak
    MEM[np.tri(n, k=-1, dtype=bool)] = INF
    return MEM


@dataclass(frozen=True, slots=True)
class _ProfileArrays:
    """Per-profile arrays (flops and memory of every partition), shared by every solve."""

    fl: np.ndarray    # flops per segment
    out: np.ndarray   # bytes each segment's output puts on a link (cut_bytes: the cut's wire)
    FL: np.ndarray    # FL[i, j] = flops of segments i..j
    MEM: np.ndarray   # MEM[i, j] = memory of segments i..j, INF below the diagonal
    mems: np.ndarray  # every partition memory, sorted, unique
    lower: np.ndarray  # the strictly lower triangle (no partition)
    min_seg: float
    #: Seconds of each segment on each device (segments x devices) when measured times
    #: apply to some device of the table (FLOP time elsewhere); None: FLOPs everywhere.
    T: np.ndarray | None = None

    @classmethod
    def of(cls, table: DeviceTable, profile: ChainProfile) -> _ProfileArrays:
        # Keyed by identity (hashing a profile costs more than a solve step); the entry holds
        # the profile itself, so the id cannot be reused while the entry exists.
        key = ("profile", id(profile))
        entry = table.cache.get(key)
        if entry is not None and entry[0] is profile:
            return entry[1]  # type: ignore[no-any-return]
        segs = profile.segments
        n = len(segs)
        fl = np.array([s.flops for s in segs])
        cfl = np.concatenate(([0.0], np.cumsum(fl)))
        MEM = _partition_memories(profile)
        hit = cls(fl, np.array([profile.cut_bytes(i) for i in range(n)]),
                  cfl[None, 1:] - cfl[:-1, None],
                  MEM, np.unique(MEM[np.isfinite(MEM)]), np.tri(n, k=-1, dtype=bool),
                  min_segment_memory(profile), _segment_seconds(table, profile, fl))
        table.cache[key] = (profile, hit)
        return hit


def _segment_seconds(table: DeviceTable, profile: ChainProfile, fl: np.ndarray
                     ) -> np.ndarray | None:
    """Segments x devices seconds: measured (by id, then class) where given, else FLOPs."""
    if not profile.segment_times:
        return None
    times = dict(profile.segment_times)
    cols = {}
    for z, (did, cls) in enumerate(zip(table.ids, table.classes or ("",) * len(table))):
        hit = measured_times(times, did, cls)
        if hit is not None:
            cols[z] = hit
    if not cols:
        return None
    T: np.ndarray = fl[:, None] / table.flops[None, :]
    for z, secs in cols.items():
        T[:, z] = secs
    return T


def _compute_cost(pa: _ProfileArrays, table: DeviceTable, idx: np.ndarray, latency: bool
                  ) -> np.ndarray:
    """Per segment (rows) and device ``idx`` (columns): compute seconds, or joules."""
    if pa.T is None:
        coef = 1.0 / table.flops[idx] if latency else table.pact[idx] / table.flops[idx]
        out: np.ndarray = pa.fl[:, None] * coef[None, :]
        return out
    return pa.T[:, idx] if latency else pa.T[:, idx] * table.pact[idx][None, :]


def kept_devices(table: DeviceTable, profile: ChainProfile, objective: str, max_chain: int,
                 free: np.ndarray, candidate: np.ndarray, always: Sequence[int] = ()
                 ) -> np.ndarray:
    """The candidates that survive dominance pruning for chains of at most ``max_chain`` partitions.

    A candidate is dropped when at least ``max_chain`` other candidates dominate it (module
    docstring); ``always`` (the source and the sink) are never dropped.
    """
    dom, weak = _dominator_lists(table, objective, profile)
    if max_chain > dom.shape[1] or not candidate.any():
        return candidate.copy()
    mems = _ProfileArrays.of(table, profile).mems
    pos = np.searchsorted(mems, free, side="right") - 1
    q = np.where(pos >= 0, mems[np.maximum(pos, 0)], -INF)
    qx = np.append(np.where(candidate, q, -INF), -INF)  # non-candidates and padding never dominate
    qa = qx[dom]
    qd = q[:, None]
    ok = (qa > qd) | ((qa == qd) & ~weak)
    keep: np.ndarray = candidate & (np.count_nonzero(ok, axis=1) < max_chain)
    for i in always:
        keep[i] = candidate[i]
    return keep


def _ends(table: DeviceTable, profile: ChainProfile, source: int, sink: int, objective: str,
          idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Cost of the input reaching each device ``idx`` from the source, and of leaving to the sink."""
    b_in, b_out = profile.input_bytes, float(profile.segments[-1].out_bytes)
    if objective != "energy":
        a0 = ((table.rtt[source] + table.rtt[idx]) / 2.0
              + 8.0 * b_in / np.minimum(table.up[source], table.down[idx]))
        e = ((table.rtt[idx] + table.rtt[sink]) / 2.0
             + 8.0 * b_out / np.minimum(table.up[idx], table.down[sink]))
    else:
        a0 = b_in * table.tx[source] + b_in * table.rx[idx]
        e = b_out * table.tx[idx] + b_out * table.rx[sink]
    a0[idx == source] = 0.0
    e[idx == sink] = 0.0
    return a0, e


def chain_length_bound(table: DeviceTable, profile: ChainProfile, source: int, sink: int,
                       objective: str, kmax: int, free: np.ndarray, candidate: np.ndarray
                       ) -> tuple[int, tuple[float, int] | None]:
    """Most partitions an optimal chain needs, and the best one-device chain ``(value, device)``.

    Any chain of ``k`` partitions costs at least ``LB(k) = head + middle + tail + cuts(k)``:
    ``head`` = min over candidates ``d`` of arrival from the source plus segment 0 on ``d``
    (the first device holds segment 0, so it fits it alone); ``tail`` likewise for the last
    segment and the departure to the sink; ``middle`` = the other segments at the cheapest
    rate of any candidate; ``cuts(k)`` = the ``k - 1`` smallest per-boundary lower bounds on a
    transfer between two *different* candidates (consecutive partitions never share a device).
    The best one-device chain is feasible, so its value ``UB >= OPT``; every ``k`` with
    ``LB(k) > UB`` is beaten, and an optimal chain has at most ``max{k : LB(k) <= UB}``
    partitions. Only valid when one partition is allowed (``min_partitions == 1``).
    """
    pa = _ProfileArrays.of(table, profile)
    n = len(pa.fl)
    idx = np.flatnonzero(candidate)
    if len(idx) == 0:
        return kmax, None
    lat = objective != "energy"
    S = _compute_cost(pa, table, idx, lat)  # segments x candidates
    a0, e = _ends(table, profile, source, sink, objective, idx)
    fr = free[idx]
    whole = np.where(fr >= pa.MEM[0, n - 1], a0 + S.sum(axis=0) + e, INF)
    best = int(np.argmin(whole))
    ub = float(whole[best])
    single = (ub, int(idx[best])) if np.isfinite(ub) else None
    if kmax <= 1 or n == 1 or single is None:
        return min(kmax, n), single
    head = float(np.min(np.where(fr >= pa.MEM[0, 0], a0 + S[0], INF)))
    tail = float(np.min(np.where(fr >= pa.MEM[n - 1, n - 1], S[-1] + e, INF)))
    # Each middle segment runs on some candidate: at least the fastest one's time.
    middle = float(S[1:-1].min(axis=1).sum()) if n > 2 else 0.0
    b = pa.out[:-1]
    if lat:
        cut = float(table.rtt[idx].min()) + 8.0 * b * max(
            float((1.0 / table.up[idx]).min()), float((1.0 / table.down[idx]).min()))
    else:
        cut = b * (float(table.tx[idx].min()) + float(table.rx[idx].min()))
    lb = head + middle + tail + np.concatenate(([0.0], np.cumsum(np.sort(cut))))  # lb[k-1]
    slack = ub + 1e-9 * abs(ub)  # rounding must never exclude the optimum's length
    k = int(np.count_nonzero(lb[:kmax] <= slack))
    return max(1, k), single


class _Problem:
    """Everything about one solve that does not change between branch-and-bound nodes."""

    def __init__(self, table: DeviceTable, profile: ChainProfile, source: int, sink: int,
                 objective: str, min_partitions: int, max_partitions: int | None,
                 free: np.ndarray, eligible: np.ndarray, prune: bool) -> None:
        pa = _ProfileArrays.of(table, profile)
        n = len(pa.fl)
        self.n = n
        self.out = pa.out
        FL, MEM = pa.FL, pa.MEM
        kmax = n if max_partitions is None else min(n, max_partitions)
        self.kmin = min_partitions
        self.latency = objective != "energy"
        # A partition count only needs tracking when a bound on it can bind.
        self.limited = kmax < n or min_partitions > 1
        self.K = kmax if self.limited else 1
        self.single: tuple[float, int] | None = None
        ok = eligible & (free >= pa.min_seg)
        self.throughput = objective == "throughput"
        if self.throughput:  # the swap argument holds for every stage, so latency keys prune
            objective = "latency"
        if prune and min_partitions <= kmax:
            P = kmax
            if min_partitions == 1 and not self.throughput:  # the length bound is for sums
                P, single = chain_length_bound(table, profile, source, sink, objective, kmax,
                                               free, ok)
                if P == 1:  # the best one-device chain is optimal: no DP needed
                    self.single = single
                    self.m = 0
                    return
            ok = kept_devices(table, profile, objective, P, free, ok, (source, sink))
        cand = np.flatnonzero(ok)
        self.cand = cand
        m = len(cand)
        self.m = m
        if m == 0 or min_partitions > kmax:
            self.m = 0
            return
        if pa.T is None:
            F = table.flops[cand]
            coef = 1.0 / F if self.latency else table.pact[cand] / F
            C = FL[:, :, None] * coef[None, None, :]
        else:  # measured seconds: C[i, j] = sum of segments i..j, by prefix sums
            S = _compute_cost(pa, table, cand, self.latency)
            CS = np.concatenate((np.zeros((1, m)), np.cumsum(S, axis=0)))
            C = CS[None, 1:, :] - CS[:-1, None, :]
        C[MEM[:, :, None] > free[cand][None, None, :]] = INF
        C[pa.lower] = INF
        self.C = C
        self.rh = table.rtt[cand] / 2.0
        self.up_c = table.up[cand]
        if self.latency:
            u = 1.0 / self.up_c
            self.u = u
            self.w = 1.0 / table.down[cand]
            self.order = np.argsort(u, kind="stable")
            self.us = u[self.order]
            self.rho = self.rh[self.order]
            self.thr = np.searchsorted(self.us, self.w, side="right")
            self.has_p = self.thr > 0
            self.has_s = self.thr < m
            self.pi = np.maximum(self.thr - 1, 0)
            self.si = np.minimum(self.thr, m - 1)
            self.selfc = 2.0 * self.rh
            self.selfm = np.maximum(u, self.w)
        else:
            self.tx = table.tx[cand]
            self.rx = table.rx[cand]
        # Arrival of the input from the source, and departure of the output to the sink.
        a0, e = _ends(table, profile, source, sink, objective, cand)
        self.a0 = a0
        self.e = e
        self.ar = np.arange(m)
        if self.throughput:  # the input's and the output's link stages (serialisation only)
            b_in, b_out = profile.input_bytes, float(profile.segments[-1].out_bytes)
            self.a0s = np.where(cand == source, 0.0,
                                8.0 * b_in / np.minimum(table.up[source], table.down[cand]))
            self.es = np.where(cand == sink, 0.0,
                               8.0 * b_out / np.minimum(table.up[cand], table.down[sink]))

    # -- arrival: min over predecessor a != d of G[a] + transfer(a, d) -------------------------

    def _sweep(self, G: np.ndarray, b: float) -> np.ndarray:
        """min over all a (self included) of G[a] + transfer(a, d), for every row and d."""
        g = G[:, self.order] + self.rho
        P = np.minimum.accumulate(g, axis=1)
        S = np.minimum.accumulate((g + (8.0 * b) * self.us)[:, ::-1], axis=1)[:, ::-1]
        pv = np.where(self.has_p, P[:, self.pi], INF) + (8.0 * b) * self.w
        sv = np.where(self.has_s, S[:, self.si], INF)
        return np.minimum(pv, sv) + self.rh

    def _pair(self, b: float, z: np.ndarray) -> np.ndarray:
        """transfer(a, z_k) for every a (rows k); the a == z_k entry is set to INF."""
        if self.latency:
            t: np.ndarray = (self.rh[None, :] + self.rh[z][:, None]
                 + (8.0 * b) * np.maximum(1.0 / self.up_c[None, :], self.w[z][:, None]))
        else:
            t = b * self.tx[None, :] + b * self.rx[z][:, None]
        t[np.arange(len(z)), z] = INF
        return t

    def arrive(self, G: np.ndarray, b: float) -> np.ndarray:
        """min over a != d of G[a] + transfer(a, d): the output of the last partition reaches d."""
        if not self.latency:
            h = G + b * self.tx
            rows = np.arange(h.shape[0])
            a1 = np.argmin(h, axis=1)
            v1 = h[rows, a1]
            h[rows, a1] = INF
            v2 = h.min(axis=1)
            self_ = self.ar[None, :] == a1[:, None]
            out: np.ndarray = np.where(self_, v2[:, None], v1[:, None]) + b * self.rx
            return out
        val = self._sweep(G, b)
        # d can only be its own argmin when its "self transfer" ties the minimum (up to rounding,
        # hence the slack): recompute those few exactly without d.
        selfv = G + (self.selfc + (8.0 * b) * self.selfm)
        bad_r, bad_z = np.nonzero((selfv <= val + 1e-9 * np.abs(val)) & np.isfinite(val))
        if len(bad_r):
            val[bad_r, bad_z] = (G[bad_r] + self._pair(b, bad_z)).min(axis=1)
        return val

    def pred(self, Vrow: np.ndarray, b: float, z: int) -> int:
        """The predecessor device chosen by ``arrive`` for device z (backtracking)."""
        return int(np.argmin(Vrow + self._pair(b, np.array([z]))[0]))

    # -- one relaxed DP under per-device range constraints -------------------------------------

    def relaxed(self, cons: dict[int, tuple[int, int, int, int]], cap: float | None = None
                ) -> tuple[float, list[tuple[int, int, int]]] | None:
        """The relaxed latency DP; with ``cap`` (throughput only), every stage at most ``cap``.

        A link stage ``8b * max(u_a, w_d) <= cap`` splits into ``u_a <= t`` and ``w_d <= t``
        (``t = cap / 8b``), so the cap masks senders and receivers and the sweep still applies.
        """
        n, m, K = self.n, self.m, self.K
        C = self.C
        if cons or cap is not None:
            C = C.copy()
            for z, (smin, smax, emin, emax) in cons.items():
                C[:smin, :, z] = INF
                C[smax + 1:, :, z] = INF
                C[:, :emin, z] = INF
                C[:, emax + 1:, z] = INF
        a0, e = self.a0, self.e
        if cap is not None:
            C[cap < C] = INF
            a0 = np.where(self.a0s <= cap, a0, INF)
            e = np.where(self.es <= cap, e, INF)
        A = np.full((n, K, m), INF)
        A[0, 0] = a0
        cands: list[np.ndarray] = [A[:0]]
        Vs: list[np.ndarray] = [A[0]]
        for jp in range(1, n + 1):
            cand = A[:jp] + C[:jp, jp - 1][:, None, :]
            V = cand.min(axis=0)
            cands.append(cand)
            t = INF
            if jp < n and cap is not None and self.out[jp - 1] > 0:
                t = cap / (8.0 * float(self.out[jp - 1])) * (1 + 1e-12)
                V = np.where(self.u[None, :] <= t, V, INF)  # senders too slow for the cap
            Vs.append(V)
            if jp < n:
                b = float(self.out[jp - 1])
                if not self.limited:
                    A[jp] = self.arrive(V, b)
                elif K > 1:
                    A[jp, 1:] = self.arrive(V[:-1], b)
                if t < INF:
                    A[jp][:, self.w > t] = INF  # receivers too slow for the cap
        tot = Vs[n] + e[None, :]
        if self.kmin > 1:
            tot[:self.kmin - 1] = INF
        flat = int(np.argmin(tot))
        best = float(tot.flat[flat])
        if not np.isfinite(best):
            return None
        r, z = divmod(flat, m)
        parts: list[tuple[int, int, int]] = []
        jp = n
        while True:
            j = int(np.argmin(cands[jp][:, r, z]))
            parts.append((j, jp - 1, z))
            if j == 0:
                break
            r = r - 1 if self.limited else 0
            z = self.pred(Vs[j][r], float(self.out[j - 1]), z)
            jp = j
        parts.reverse()
        return best, parts


    # -- throughput: bottleneck DP, and latency DP under a cap on every stage --------------------

    def stage_values(self) -> np.ndarray:
        """Every finite stage time a chain could have (and a few more), sorted and unique.

        A link stage is ``8b * max(u_a, w_d)``: ``8b`` times one of the ``u`` or ``w`` values.
        """
        vals = [self.C[np.isfinite(self.C)], self.a0s, self.es]
        uw = np.unique(np.concatenate((self.u, self.w)))
        vals += [(8.0 * float(self.out[j])) * uw for j in range(self.n - 1)]
        allv = np.concatenate(vals)
        return np.unique(allv[np.isfinite(allv)])


def _repeat(parts: list[tuple[int, int, int]]) -> tuple[int, int] | None:
    """A device used twice and the first segment after its first partition, or None."""
    seen: dict[int, int] = {}
    for _first, last, z in parts:
        if z in seen:
            return z, seen[z]
        seen[z] = last + 1
    return None


Relax = Callable[[dict[int, tuple[int, int, int, int]]],
                 "tuple[float, list[tuple[int, int, int]]] | None"]


def _bnb(relax: Relax, n: int, node_limit: int, spent: list[int] | None = None
         ) -> tuple[float, list[tuple[int, int, int]], bool, int] | None:
    """Best-first branch and bound over device-range constraints (module docstring).

    Returns (value, parts in candidate indices, exact, nodes) or None when infeasible (or the
    node limit came first: ``spent``, when given, gets ``[nodes, 1 if that was exact]``).
    """
    got = _bnb_core(relax, n, node_limit)
    if spent is not None:
        spent[:] = [got[1], int(got[2])]
    return got[0]


def _bnb_core(relax: Relax, n: int, node_limit: int
              ) -> tuple[tuple[float, list[tuple[int, int, int]], bool, int] | None, int, bool]:
    incumbent: tuple[float, list[tuple[int, int, int]]] | None = None
    heap: list[tuple[float, int, dict[int, tuple[int, int, int, int]], list]] = []
    tick = 0
    nodes = 0
    root = relax({})
    nodes += 1
    if root is None:
        return None, nodes, True
    heap.append((root[0], tick, {}, root[1]))
    exact = True
    while heap:
        lb, _, cons, parts = heapq.heappop(heap)
        if incumbent is not None and lb >= incumbent[0] - 1e-12 * abs(incumbent[0]):
            break
        rep = _repeat(parts)
        if rep is None:
            incumbent = (lb, parts)
            break  # best-first: the smallest open bound is feasible, hence optimal
        if nodes >= node_limit:
            exact = False
            break
        z, mm = rep
        smin, smax, emin, emax = cons.get(z, (0, n - 1, 0, n - 1))
        for child in ((smin, smax, emin, min(emax, mm - 1)),
                      (max(smin, mm), smax, emin, emax),
                      (smin, min(smax, mm - 1), max(emin, mm), emax)):
            if child[0] > child[1] or child[2] > child[3]:
                continue
            c2 = dict(cons)
            c2[z] = child
            res = relax(c2)
            nodes += 1
            if res is None:
                continue
            if incumbent is not None and res[0] >= incumbent[0]:
                continue
            if _repeat(res[1]) is None and (incumbent is None or res[0] < incumbent[0]):
                incumbent = res
            tick += 1
            heapq.heappush(heap, (res[0], tick, c2, res[1]))
    if incumbent is None:
        return None, nodes, exact
    return (incumbent[0], incumbent[1], exact, nodes), nodes, exact


def _throughput(pb: _Problem, max_latency_s: float | None, node_limit: int
                ) -> tuple[float, list[tuple[int, int, int]], bool, int] | None:
    """The smallest bottleneck of a chain within the latency bound, and the fastest such chain.

    ``lat(cap)`` = the least latency over chains whose every stage is at most ``cap`` is
    non-increasing in ``cap``, and the optimal bottleneck is one of the finitely many stage
    times; so it is the smallest stage time ``cap`` with ``lat(cap) <= max_latency_s``
    (bisection), and the chain returned is the fastest with that bottleneck. The search runs
    between a lower bound (the bottleneck relaxation: devices may be revisited) and the
    bottleneck of the fastest chain, which is feasible whenever any chain is. Capped latency
    solves rarely revisit a device (a revisit costs two transfers), so they stay small where a
    bottleneck branch and bound would not.
    """
    bound = INF if max_latency_s is None else max_latency_s * (1 + 1e-12)
    fast = _bnb(pb.relaxed, pb.n, node_limit)
    if fast is None or fast[0] > bound:
        return None  # no chain at all, or none within the latency bound
    nodes, exact = fast[3], fast[2]
    # Lower bound: each segment runs in some partition, so on some device; the input and the
    # output cross some link (0 when the source or sink computes).
    diag = pb.C[np.arange(pb.n), np.arange(pb.n)]  # segments x candidates
    lb = max(float(pb.a0s.min()), float(pb.es.min()), float(np.max(diag.min(axis=1))))
    vals = pb.stage_values()
    ub = _bottleneck(pb, fast[1])
    cand = vals[(vals >= lb) & (vals < ub)]
    cand = np.append(cand, ub)
    best, tau = fast[1], ub
    budget = 4 * node_limit  # the whole search; beyond it, the best chain found (not exact)
    lo, hi = 0, len(cand) - 2  # cand[-1] (the fastest chain's bottleneck) is feasible
    while lo <= hi:
        if budget <= 0:
            exact = False
            break
        mid = (lo + hi) // 2
        spent = [0, 1]
        res = _bnb(functools.partial(pb.relaxed, cap=float(cand[mid])), pb.n,
                   min(node_limit, budget), spent)
        budget -= spent[0]
        nodes += spent[0]
        exact = exact and bool(spent[1])
        if res is not None and res[0] <= bound:
            best, tau, hi = res[1], float(cand[mid]), mid - 1
        else:
            lo = mid + 1
    # (when no smaller cap is feasible, the fastest chain of all is the fastest with bottleneck ub)
    return tau, best, exact, nodes


def _bottleneck(pb: _Problem, parts: list[tuple[int, int, int]]) -> float:
    """The slowest stage of a chain (candidate indices), as ``relaxed`` caps them."""
    worst = max(float(pb.a0s[parts[0][2]]), float(pb.es[parts[-1][2]]))
    for k, (f, last, d) in enumerate(parts):
        worst = max(worst, float(pb.C[f, last, d]))
        if k:
            prev = parts[k - 1][2]
            worst = max(worst, float((8.0 * float(pb.out[f - 1])) * max(pb.u[prev], pb.w[d])))
    return worst


def solve_chain(table: DeviceTable, profile: ChainProfile, source: int, sink: int, *,
                objective: str = "latency", max_partitions: int | None = None,
                free: np.ndarray | None = None, eligible: np.ndarray | None = None,
                node_limit: int = 200, min_partitions: int = 1,
                prune: bool | None = None, max_latency_s: float | None = None
                ) -> ChainSolution | None:
    """The cheapest chain for ``profile`` from ``source`` to ``sink`` (table indices), or None.

    ``free`` is each device's free memory, ``eligible`` the devices that passed the filters;
    the chain has between ``min_partitions`` and ``max_partitions`` partitions. Dominance
    pruning never changes the optimum; ``prune=None`` (default) prunes from the second solve on
    a table, so a one-off solve on a fresh snapshot does not pay for the dominator lists.

    ``objective="throughput"`` minimises the bottleneck stage (``cost.stage_times``; the
    value is its seconds, frames/s = 1 / value), among chains whose latency is at most
    ``max_latency_s``; the latency objective also honours ``max_latency_s`` (None when the
    fastest chain exceeds it). The energy objective does not take a latency bound.
    """
    if max_latency_s is not None and objective == "energy":
        raise ValueError("a latency bound applies to the latency and throughput objectives")
    D = len(table)
    if prune is None:
        warm = table.cache.get("solves", 0)
        table.cache["solves"] = warm + 1
        prune = warm > 0
    free = table.memory if free is None else free
    eligible = np.ones(D, dtype=bool) if eligible is None else eligible
    pb = _Problem(table, profile, source, sink, objective, max(1, min_partitions),
                  max_partitions, free, eligible, prune)
    bound = INF if max_latency_s is None else max_latency_s * (1 + 1e-12)
    if pb.single is not None:
        value, z = pb.single
        if value > bound:
            return None
        return ChainSolution(((0, pb.n - 1, z),), value, True, 0)
    if pb.m == 0:
        return None
    if pb.throughput:
        got = _throughput(pb, max_latency_s, node_limit)
    else:
        got = _bnb(pb.relaxed, pb.n, node_limit)
        if got is not None and got[0] > bound:
            return None
    if got is None:
        return None
    value, parts, exact, nodes = got
    return ChainSolution(tuple((f, last, int(pb.cand[z])) for f, last, z in parts), value,
                         exact, nodes)
