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
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .model import ChainProfile, Device

__all__ = ["DeviceTable", "ChainSolution", "solve_chain", "min_segment_memory"]

INF = float("inf")


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

    @classmethod
    def from_devices(cls, devices: Sequence[Device]) -> DeviceTable:
        def col(name: str) -> np.ndarray:
            return np.array([getattr(d, name) for d in devices], dtype=np.float64)
        return cls(tuple(d.id for d in devices), col("flops"), col("memory_bytes"),
                   col("uplink_bps"), col("downlink_bps"), col("rtt_s"),
                   col("power_active_w"), col("tx_j_per_byte"), col("rx_j_per_byte"))

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


class _Problem:
    """Everything about one solve that does not change between branch-and-bound nodes."""

    def __init__(self, table: DeviceTable, profile: ChainProfile, source: int, sink: int,
                 objective: str, max_partitions: int | None, free: np.ndarray,
                 eligible: np.ndarray) -> None:
        segs = profile.segments
        n = len(segs)
        self.n = n
        fl = np.array([s.flops for s in segs])
        pb = np.array([s.param_bytes for s in segs])
        act = np.array([s.activation_bytes for s in segs])
        self.out = np.array([s.out_bytes for s in segs])
        cfl = np.concatenate(([0.0], np.cumsum(fl)))
        cpb = np.concatenate(([0.0], np.cumsum(pb)))
        FL = cfl[None, 1:] - cfl[:-1, None]           # FL[i, j] = flops of segments i..j
        MEM = cpb[None, 1:] - cpb[:-1, None]
        peak = np.full((n, n), -INF)
        for i in range(n):
            peak[i, i:] = np.maximum.accumulate(act[i:])
        MEM = MEM + peak
        tri = np.triu(np.ones((n, n), dtype=bool))
        MEM[~tri] = INF

        cand = np.flatnonzero(eligible & (free >= min_segment_memory(profile)))
        self.cand = cand
        m = len(cand)
        self.m = m
        self.latency = objective != "energy"
        # A partition count only needs tracking when the cap can bind (it cannot above n).
        if max_partitions is not None and max_partitions < n:
            self.K = max_partitions
            self.limited = True
        else:
            self.K = 1
            self.limited = False
        if m == 0:
            return
        F = table.flops[cand]
        coef = 1.0 / F if self.latency else table.pact[cand] / F
        C = FL[:, :, None] * coef[None, None, :]
        C[MEM[:, :, None] > free[cand][None, None, :]] = INF
        C[~tri] = INF
        self.C = C
        self.rh = table.rtt[cand] / 2.0
        if self.latency:
            self.up_c = table.up[cand]
            u = 1.0 / self.up_c
            self.u = u
            self.w = 1.0 / table.down[cand]
            self.order = np.argsort(u, kind="stable")
            self.us = u[self.order]
            self.thr = np.searchsorted(self.us, self.w, side="right")
        else:
            self.tx = table.tx[cand]
            self.rx = table.rx[cand]
            self.up_c = table.up[cand]
        # Arrival of the input from the source, and departure of the output to the sink.
        b_in, b_out = profile.input_bytes, float(self.out[-1])
        if self.latency:
            a0 = ((table.rtt[source] + table.rtt[cand]) / 2.0
                  + 8.0 * b_in / np.minimum(table.up[source], table.down[cand]))
            e = ((table.rtt[cand] + table.rtt[sink]) / 2.0
                 + 8.0 * b_out / np.minimum(table.up[cand], table.down[sink]))
        else:
            a0 = b_in * table.tx[source] + b_in * table.rx[cand]
            e = b_out * table.tx[cand] + b_out * table.rx[sink]
        a0[cand == source] = 0.0
        e[cand == sink] = 0.0
        self.a0 = a0
        self.e = e
        self.ar = np.arange(m)

    # -- arrival: min over predecessor a != d of G[a] + transfer(a, d) -------------------------

    def _sweep(self, G: np.ndarray, b: float) -> np.ndarray:
        """min over all a (self included) of G[a] + transfer(a, d), for every row and d."""
        m, order, thr = self.m, self.order, self.thr
        g = G[:, order] + self.rh[order]
        P = np.minimum.accumulate(g, axis=1)
        S = np.minimum.accumulate((g + (8.0 * b) * self.us)[:, ::-1], axis=1)[:, ::-1]
        pv = np.where(thr > 0, P[:, np.maximum(thr - 1, 0)], INF) + (8.0 * b) * self.w
        sv = np.where(thr < m, S[:, np.minimum(thr, m - 1)], INF)
        return np.minimum(pv, sv) + self.rh

    def _pair(self, b: float, z: np.ndarray) -> np.ndarray:
        """transfer(a, z_k) for every a (rows k); the a == z_k entry is set to INF."""
        if self.latency:
            t = (self.rh[None, :] + self.rh[z][:, None]
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
            return np.where(self_, v2[:, None], v1[:, None]) + b * self.rx
        val = self._sweep(G, b)
        # d can only be its own argmin when its "self transfer" ties the minimum (up to rounding,
        # hence the slack): recompute those few exactly without d.
        selfv = G + (2.0 * self.rh + (8.0 * b) * np.maximum(self.u, self.w))[None, :]
        bad_r, bad_z = np.nonzero((selfv <= val + 1e-9 * np.abs(val)) & np.isfinite(val))
        if len(bad_r):
            val[bad_r, bad_z] = (G[bad_r] + self._pair(b, bad_z)).min(axis=1)
        return val

    def pred(self, Vrow: np.ndarray, b: float, z: int) -> int:
        """The predecessor device chosen by ``arrive`` for device z (backtracking)."""
        return int(np.argmin(Vrow + self._pair(b, np.array([z]))[0]))

    # -- one relaxed DP under per-device range constraints -------------------------------------

    def relaxed(self, cons: dict[int, tuple[int, int, int, int]]
                ) -> tuple[float, list[tuple[int, int, int]]] | None:
        n, m, K = self.n, self.m, self.K
        C = self.C
        if cons:
            C = C.copy()
            for z, (smin, smax, emin, emax) in cons.items():
                C[:smin, :, z] = INF
                C[smax + 1:, :, z] = INF
                C[:, :emin, z] = INF
                C[:, emax + 1:, z] = INF
        A = np.full((n, K, m), INF)
        A[0, 0] = self.a0
        frm: list[np.ndarray] = [np.zeros(0, dtype=np.int64)]
        Vs: list[np.ndarray] = [np.zeros(0)]
        for jp in range(1, n + 1):
            cand = A[:jp] + C[:jp, jp - 1][:, None, :]
            f = np.argmin(cand, axis=0)
            V = np.take_along_axis(cand, f[None], axis=0)[0]
            frm.append(f)
            Vs.append(V)
            if jp < n:
                b = float(self.out[jp - 1])
                if not self.limited:
                    A[jp] = self.arrive(V, b)
                elif K > 1:
                    A[jp, 1:] = self.arrive(V[:-1], b)
        tot = Vs[n] + self.e[None, :]
        flat = int(np.argmin(tot))
        best = float(tot.flat[flat])
        if not np.isfinite(best):
            return None
        r, z = divmod(flat, m)
        parts: list[tuple[int, int, int]] = []
        jp = n
        while True:
            j = int(frm[jp][r, z])
            parts.append((j, jp - 1, z))
            if j == 0:
                break
            r = r - 1 if self.limited else 0
            z = self.pred(Vs[j][r], float(self.out[j - 1]), z)
            jp = j
        parts.reverse()
        return best, parts


def _repeat(parts: list[tuple[int, int, int]]) -> tuple[int, int] | None:
    """A device used twice and the first segment after its first partition, or None."""
    seen: dict[int, int] = {}
    for first, last, z in parts:
        if z in seen:
            return z, seen[z]
        seen[z] = last + 1
    return None


def solve_chain(table: DeviceTable, profile: ChainProfile, source: int, sink: int, *,
                objective: str = "latency", max_partitions: int | None = None,
                free: np.ndarray | None = None, eligible: np.ndarray | None = None,
                node_limit: int = 200) -> ChainSolution | None:
    """The cheapest chain for ``profile`` from ``source`` to ``sink`` (table indices), or None.

    ``free`` is each device's free memory, ``eligible`` the devices that passed the filters.
    """
    D = len(table)
    free = table.memory if free is None else free
    eligible = np.ones(D, dtype=bool) if eligible is None else eligible
    pb = _Problem(table, profile, source, sink, objective, max_partitions, free, eligible)
    if pb.m == 0:
        return None
    n = pb.n
    incumbent: tuple[float, list[tuple[int, int, int]]] | None = None
    heap: list[tuple[float, int, dict[int, tuple[int, int, int, int]], list]] = []
    tick = 0
    nodes = 0
    root = pb.relaxed({})
    nodes += 1
    if root is None:
        return None
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
            res = pb.relaxed(c2)
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
        return None
    value, parts = incumbent
    return ChainSolution(tuple((f, l, int(pb.cand[z])) for f, l, z in parts), value,
                         exact, nodes)
