"""The router's completion-time model (pure): when would a request sent down a chain now finish?

Kept apart from ``fog_broker.router``'s request bookkeeping so that what the router *predicts*
(measured stage times, stages that batch, the work queued at each device, each chain's learned
overhead and its deviation) has one place, and the router only decides with it.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

from runtime.batch_cost import drain_s
from runtime.messages import Hop

__all__ = ["CompletionModel", "Chain", "StageKey"]

Chain = tuple[int, tuple[Hop, ...]]  # (replica, route)
StageKey = tuple[str, int, int, int]  # workload, version, replica, index

_MAX_STAGES = 20_000   # measured stage times kept (bounded whatever devices report)


class CompletionModel:
    """Stage times, batch slopes, device queues and learned per-chain overheads of one router."""

    def __init__(self, overhead_gain: float, max_overhead_s: float, margin_devs: float) -> None:
        self.overhead_gain = overhead_gain
        self.max_overhead_s = max_overhead_s
        self.margin_devs = margin_devs
        self.stage_s: dict[StageKey, float] = {}       # measured compute per stage (state adverts)
        self.stage_batch: dict[StageKey, tuple[int, float]] = {}  # stages that batch: (max batch, cost slope)
        self.work: dict[str, float] = {}               # device -> seconds of outstanding stage work
        self.overhead: dict[tuple[str, int], float] = {}  # (workload, replica) -> learned overhead (s)
        self.dev: dict[tuple[str, int], float] = {}       # its mean deviation (s): the admission margin

    def note_stage(self, key: StageKey, seconds: float) -> None:
        if not (seconds > 0 and math.isfinite(seconds)):
            return
        if key not in self.stage_s and len(self.stage_s) >= _MAX_STAGES:
            self.stage_s.pop(next(iter(self.stage_s)))
        self.stage_s[key] = float(seconds)

    def note_batch(self, key: StageKey, max_batch: int, slope: float) -> None:
        if max_batch <= 1 or not math.isfinite(slope):
            self.stage_batch.pop(key, None)
            return
        if key not in self.stage_batch and len(self.stage_batch) >= _MAX_STAGES:
            self.stage_batch.pop(next(iter(self.stage_batch)))
        self.stage_batch[key] = (int(max_batch), max(0.0, float(slope)))

    def forget(self, workload: str) -> None:
        for k in [k for k in self.stage_s if k[0] == workload]:
            del self.stage_s[k]
        for k in [k for k in self.stage_batch if k[0] == workload]:
            del self.stage_batch[k]
        for c in [c for c in self.overhead if c[0] == workload]:
            del self.overhead[c]
            self.dev.pop(c, None)

    def stages(self, workload: str, chain: Chain) -> list[float] | None:
        """Measured stage seconds of a chain's hops, or None while any is unknown."""
        out = []
        for h in chain[1]:
            s = self.stage_s.get((workload, h.version, h.replica, h.index))
            if s is None:
                return None
            out.append(s)
        return out

    def bottleneck(self, workload: str, chain: Chain) -> float:
        st = self.stages(workload, chain)
        return max(st) if st else 0.0

    def predict(self, workload: str, chain: Chain) -> float | None:
        """Seconds a request sent down ``chain`` now would take: the longest wait at one of its
        devices, its stage times and its learned overhead (None: some stage unmeasured)."""
        stages = self.stages(workload, chain)
        if stages is None:
            return None
        wait = max(self.wait_at(workload, h, st) for h, st in zip(chain[1], stages))
        return wait + sum(stages) + self.overhead.get((workload, chain[0]), 0.0)

    def wait_at(self, workload: str, hop: Hop, stage_s: float) -> float:
        """Predicted wait at a hop's device: its outstanding work, drained in batches where the stage
        batches (the work in frames of this stage, at the stage's batch cost)."""
        work = self.work.get(hop.device_id, 0.0)
        batch = self.stage_batch.get((workload, hop.version, hop.replica, hop.index))
        if batch is None or work <= 0 or stage_s <= 0:
            return work
        return drain_s(stage_s, math.ceil(work / stage_s - 1e-9), batch[0], batch[1])

    def unloaded(self, workload: str, chains: Sequence[Chain]) -> float | None:
        """Seconds the fastest measured chain takes with nothing queued (None: none measured)."""
        best: float | None = None
        for c in chains:
            st = self.stages(workload, c)
            if st is not None and c[1]:
                t = sum(st) + self.overhead.get((workload, c[0]), 0.0)
                best = t if best is None else min(best, t)
        return best

    def margin(self, workload: str, chain: Chain) -> float:
        return self.margin_devs * self.dev.get((workload, chain[0]), 0.0)

    def learn(self, workload: str, chain: Chain, took_s: float, wait_s: float) -> None:
        """An answer's latency beyond its predicted queueing and stage times: the chain's overhead
        (network, codec, the devices' own queues of other work), learned as an EWMA."""
        stages = self.stages(workload, chain)
        if stages is None:
            return
        resid = took_s - wait_s - sum(stages)
        key = (workload, chain[0])
        old = self.overhead.get(key)
        g = self.overhead_gain
        new = resid if old is None else old + g * (resid - old)
        if old is not None:
            dev = self.dev.get(key, 0.0)
            self.dev[key] = min(dev + g * (abs(resid - old) - dev), self.max_overhead_s)
        self.overhead[key] = min(max(new, 0.0), self.max_overhead_s)
