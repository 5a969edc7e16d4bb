"""Shared builders and an independent brute-force optimiser for placement tests."""
from __future__ import annotations

import itertools
import random
from dataclasses import replace

from fog_broker.placement import ChainProfile, Device, PartitionPlacement, Segment, chain_cost


def dev(i: str, **kw: object) -> Device:
    base: dict[str, object] = dict(flops=1e9, memory_bytes=1e6, uplink_bps=1e7, downlink_bps=1e7,
                                   rtt_s=1e-3, power_active_w=5.0, power_idle_w=0.0, tx_j_per_byte=1e-7,
                                   rx_j_per_byte=1e-7)
    base.update(kw)
    return Device(id=i, **base)  # type: ignore[arg-type]


def profile(n: int, *, flops: float = 1e8, params: float = 1e5, act: float = 5e4,
            out: float = 1e4, inp: float = 3072.0) -> ChainProfile:
    return ChainProfile("m", inp, tuple(Segment(f"s{i}", flops, params, act, out)
                                        for i in range(n)))


def random_instance(rng: random.Random, n_dev: int, n_seg: int,
                    tight: bool = True) -> tuple[list[Device], ChainProfile]:
    devs = []
    for i in range(n_dev):
        devs.append(Device(
            id=f"d{i}", flops=rng.choice([1e8, 5e8, 2e9, 1e10]) * rng.uniform(0.5, 2),
            memory_bytes=int(rng.uniform(1e5, 2e6)) if tight else 10**9,
            uplink_bps=rng.choice([1e6, 1e7, 1e8]) * rng.uniform(0.5, 2),
            downlink_bps=rng.choice([1e6, 1e7, 1e8]) * rng.uniform(0.5, 2),
            rtt_s=rng.uniform(1e-4, 2e-2), power_active_w=rng.uniform(1, 20), power_idle_w=0.0,
            tx_j_per_byte=rng.uniform(1e-8, 1e-6), rx_j_per_byte=rng.uniform(1e-8, 1e-6),
            labels={"power-domain": f"p{i % 3}"}))
    segs = tuple(Segment(f"s{i}", rng.uniform(1e6, 1e9), rng.uniform(1e4, 6e5),
                         rng.uniform(1e4, 3e5), rng.uniform(1e3, 2e5)) for i in range(n_seg))
    return devs, ChainProfile("m", rng.uniform(1e3, 1e5), segs)


def brute_force(devs: list[Device], prof: ChainProfile, source: str, sink: str, objective: str,
                max_partitions: int | None, free: dict[str, float] | None = None,
                min_partitions: int = 1, max_latency_s: float | None = None
                ) -> tuple[float, list[PartitionPlacement]] | None:
    """Enumerate every composition of the segments and every injective device assignment.

    ``objective="throughput"`` minimises the bottleneck stage; ``max_latency_s`` drops every
    chain slower than it end to end.
    """
    n = len(prof.segments)
    dm = {d.id: d for d in devs}
    free = free or {d.id: d.memory_bytes for d in devs}
    best: tuple[float, list[PartitionPlacement]] | None = None
    for k in range(min_partitions, min(n, max_partitions or n) + 1):
        for cuts in itertools.combinations(range(1, n), k - 1):
            b = (0, *cuts, n)
            parts = [(b[i], b[i + 1] - 1) for i in range(k)]
            for perm in itertools.permutations(devs, k):
                if any(prof.memory_of(f, last) > free[d.id] for (f, last), d in zip(parts, perm)):
                    continue
                pl = [PartitionPlacement(f, last, d.id) for (f, last), d in zip(parts, perm)]
                cc = chain_cost(prof, pl, dm, source, sink)
                if max_latency_s is not None and cc.latency_s > max_latency_s:
                    continue
                c = cc.objective(objective)
                if best is None or c < best[0]:
                    best = (c, pl)
    return best


def dominated_fleet(rng: random.Random, n_base: int, copies: int,
                    tight: bool = True) -> list[Device]:
    """Random base devices plus copies no better in any component (some exact duplicates).

    Dominance is rare among independent random devices; these fleets make pruning bite, with
    ties in every component and in memory so the tie-breaking rule is exercised too.
    """
    base, _ = random_instance(rng, n_base, 1, tight=tight)
    mems = [int(rng.uniform(1e5, 2e6)) if tight else 10**9 for _ in range(3)]
    devs: list[Device] = []
    for i, b in enumerate(base):
        b = replace(b, memory_bytes=rng.choice(mems))
        devs.append(replace(b, id=f"b{i}"))
        for c in range(copies):
            def worse(v: float, up: bool) -> float:
                f = rng.choice([1.0, 1.0, rng.uniform(1.0, 3.0)])
                return v / f if up else v * f
            devs.append(replace(
                b, id=f"b{i}c{c}", flops=worse(b.flops, True),
                memory_bytes=int(rng.choice([b.memory_bytes, worse(b.memory_bytes, True)])),
                uplink_bps=worse(b.uplink_bps, True), downlink_bps=worse(b.downlink_bps, True),
                rtt_s=worse(b.rtt_s, False), power_active_w=worse(b.power_active_w, False),
                tx_j_per_byte=worse(b.tx_j_per_byte, False),
                rx_j_per_byte=worse(b.rx_j_per_byte, False),
                labels={"power-domain": f"p{(i + c) % 3}"}))
    rng.shuffle(devs)
    return devs
